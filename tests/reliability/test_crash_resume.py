"""SIGKILL a real ``collage train`` process and resume it (issue #8, item 5).

Each round starts ``collage train`` in a subprocess with a checkpoint after every step and
kills it with SIGKILL at a seeded random point, in one of four places:

* ``train``: at a random time while it trains (after a random number of checkpoints plus a
  random delay, so the kill lands in forward, backward, the update or a save);
* ``write``: half-way through writing a checkpoint's temporary file;
* ``rename``: with the temporary file complete, just before ``os.replace`` publishes it;
* ``final``: half-way through writing ``model_fp32.pt`` (atomically) after the last step.

(_train_driver.py freezes the real process at those points; the harness's code is not
changed.) Then: ``checkpoint.pt`` is never corrupt and holds the last complete step (a
partial save leaves the previous checkpoint in place); ``--resume`` continues from exactly
that step; and the resumed run ends bitwise where an uninterrupted run ends: the same losses,
learning rates and gradient norms at every step and the same final fp32 weights. Dropout is
on and the strategies alternate between ``plus`` and ``stochastic`` (seeded stochastic
rounding), so the torch and optimizer random streams must resume exactly too.

Default run (so CI runs it): 20 rounds in a row cycling through all four places (~1 minute);
``-m slow`` adds 20 more with another seed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from collage.cli import main as cli_main


STEPS = 20
DRIVER = Path(__file__).with_name("_train_driver.py")
MODES = ("train", "write", "rename", "final")
STRATEGIES = ("plus", "stochastic")
COMPARED = ("step", "train_loss", "lr", "grad_norm", "val_step", "val_loss")


def _argv(out: Path, strategy: str) -> list[str]:
    return ["train", "--preset", "micro", "--strategy", strategy, "--steps", str(STEPS),
            "--eval-every", "4", "--checkpoint-every", "1", "--track-every", "0",
            "--dropout", "0.1", "--threads", "1", "--out", str(out)]


def _in_process(argv: list[str]) -> None:
    """``collage train`` in this process, leaving its global state (threads, RNG) as found."""
    threads, python_rng = torch.get_num_threads(), random.getstate()
    with torch.random.fork_rng():
        try:
            assert cli_main(argv) == 0
        finally:
            torch.set_num_threads(threads)
            random.setstate(python_rng)


def _outputs(out: Path) -> tuple[dict, dict]:
    with open(out / "history.json") as handle:
        history = json.load(handle)
    weights = torch.load(out / "model_fp32.pt", weights_only=True)
    return {k: history[k] for k in COMPARED}, weights


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """Uninterrupted runs of each strategy (the same command without a kill)."""
    results = {}
    for strategy in STRATEGIES:
        out = tmp_path_factory.mktemp(f"reference-{strategy}")
        _in_process(_argv(out, strategy) + ["--quiet"])
        results[strategy] = _outputs(out)
    return results


def _checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint; None if there is none. Raises if it is corrupt."""
    if not path.exists():
        return None
    return int(torch.load(path, map_location="cpu", weights_only=True)["step"])


def _wait(predicate, proc: subprocess.Popen, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"collage train exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _kill_round(tmp_path: Path, index: int, mode: str, strategy: str, rng: random.Random,
                references: dict, capsys) -> None:
    out = tmp_path / f"round{index}-{mode}-{strategy}"
    checkpoint = out / "checkpoint.pt"
    marker = tmp_path / f"paused{index}"
    env = dict(os.environ, RELIABILITY_PAUSE="" if mode == "train" else mode,
               RELIABILITY_MARKER=str(marker))
    pause_at = rng.randint(2, STEPS - 1)  # the pause_at-th save is of step pause_at
    env["RELIABILITY_PAUSE_AT"] = str(pause_at)
    proc = subprocess.Popen([sys.executable, str(DRIVER), *_argv(out, strategy), "--quiet"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if mode == "train":
            # after a random checkpoint in the first half, plus a random delay shorter than
            # the ten or more steps still to go (each writes a checkpoint), so that the kill
            # lands anywhere in a step or a save, never after the run has finished
            after = rng.randint(1, STEPS // 2)
            _wait(lambda: (_checkpoint_step(checkpoint) or 0) >= after, proc,
                  f"checkpoint {after}")
            time.sleep(rng.uniform(0.0, 0.15))
        else:
            _wait(marker.exists, proc, f"the pause in {mode}")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed ({proc.returncode})"

    # the checkpoint on disk is complete (torch.load succeeds) and is the last complete one
    saved = _checkpoint_step(checkpoint)
    assert saved is not None
    if mode in ("write", "rename"):
        assert saved == pause_at - 1, (saved, pause_at)
        # the kill did hit a save: its temporary file is there (half-written for "write")
        leftovers = list(out.glob(".tmp-*.pt"))
        assert len(leftovers) == 1, leftovers
        if mode == "write":
            with pytest.raises(Exception):
                torch.load(leftovers[0], weights_only=True)
    elif mode == "final":
        assert saved == STEPS
        # the export is atomic too: the kill left a half-written temporary file, and no
        # model_fp32.pt at all rather than a truncated one
        assert not (out / "model_fp32.pt").exists()
        leftovers = list(out.glob(".tmp-*.pt"))
        assert len(leftovers) == 1, leftovers
        with pytest.raises(Exception):
            torch.load(leftovers[0], weights_only=True)
    assert 1 <= saved <= STEPS

    capsys.readouterr()
    _in_process(_argv(out, strategy) + ["--resume"])
    log = capsys.readouterr().out
    assert f"resuming {strategy} from step {saved}" in log, log

    history, weights = _outputs(out)
    ref_history, ref_weights = references[strategy]
    assert history == ref_history, f"round {index} ({mode}): the resumed run diverged"
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, ref_weights[name]), f"round {index} ({mode}): {name}"


def _rounds(count: int, seed: int):
    rng = random.Random(seed)
    return [(i, MODES[i % len(MODES)], STRATEGIES[(i + i // len(MODES)) % 2], rng)
            for i in range(count)]


def test_sigkill_then_resume(tmp_path, references, capsys):
    """The issue's acceptance, in the default run: 20 kill/resume rounds in a row (during
    training, while writing a checkpoint, just before publishing one, while writing the
    final weights), each resumed and compared bitwise."""
    for index, mode, strategy, rng in _rounds(20, seed=0):
        _kill_round(tmp_path, index, mode, strategy, rng, references, capsys)


@pytest.mark.slow
def test_sigkill_then_resume_20_more(tmp_path, references, capsys):
    """20 more kill/resume rounds with another seed."""
    for index, mode, strategy, rng in _rounds(20, seed=1):
        _kill_round(tmp_path, index, mode, strategy, rng, references, capsys)
