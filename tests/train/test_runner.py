"""Training runs: reproducibility, identical starting points, schedule, checkpoints, resume."""

from __future__ import annotations

import math
import os

import pytest
import torch

from collage.errors import UsageError
from collage.train.config import OptimConfig
from collage.train.build import lr_factor
from collage.train.checkpoint import (
    CHECKPOINT_NAME,
    load_checkpoint,
    payload_digest,
    save_atomic,
    save_checkpoint,
)
from collage.train.runner import train_strategy

from .conftest import micro_config


def _losses(result):
    h = result["history"]
    return h["train_loss"], h["val_loss"]


@pytest.mark.parametrize("strategy", ["plus", "stochastic"])
def test_identical_seeds_give_identical_curves(micro, strategy):
    a = train_strategy(micro, strategy)
    b = train_strategy(micro, strategy)
    assert _losses(a) == _losses(b)
    assert a["history"]["edq"] == b["history"]["edq"]
    other = train_strategy(micro.replace(run={"seed": 1}), strategy)
    assert _losses(other) != _losses(a)


def test_every_strategy_starts_from_the_same_weights(micro):
    fp32 = train_strategy(micro, "fp32")["summary"]
    bf16 = train_strategy(micro, "bf16")["summary"]
    assert fp32["init_checksum"] == bf16["init_checksum"]
    # bf16 rounds the same fp32 init: the first validation loss differs by rounding only
    assert fp32["n_params"] == bf16["n_params"]


def test_summary_fields(micro):
    s = train_strategy(micro, "plus")["summary"]
    for key in ("final_val_loss", "final_val_ppl", "tokens_per_s", "peak_memory_bytes",
                "edq_mean", "imprecision_mean", "persistent_bytes"):
        assert isinstance(s[key], (int, float)) and math.isfinite(s[key]), key
    assert s["final_val_ppl"] == pytest.approx(math.exp(s["final_val_loss"]))
    # one step (the second: the first measures lost updates) measured by the allocator
    assert s["peak_memory_measured"] == "cpu_allocator_events, step 2"
    assert s["persistent_bytes"] <= s["optimizer_step_peak_bytes"] <= s["peak_memory_bytes"]
    assert s["steps"] == micro.run.steps and s["completed"]
    assert {"embedding", "attention", "mlp", "norm", "head"} <= set(s["family"])
    assert 0.9 < s["family"]["mlp"]["edq"] < 1.1


def test_lr_schedule():
    o = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_factor(s, o, 110) for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    assert lr_factor(50, OptimConfig(warmup_steps=0, schedule="constant"), 100) == 1.0
    linear = OptimConfig(warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(50, linear, 101) == pytest.approx(0.5)


@pytest.mark.parametrize("strategy", ["plus", "stochastic", "mixed"])
def test_interrupted_run_resumes_exactly(tmp_path, strategy):
    config = micro_config(run={"steps": 8, "eval_every": 2, "track_every": 3})
    full = train_strategy(config, strategy)
    out = str(tmp_path)
    first = train_strategy(config, strategy, out_dir=out, checkpoint_every=2, stop_after=5)
    assert first["summary"]["steps"] == 5 and not first["summary"]["completed"]
    saved = torch.load(os.path.join(out, CHECKPOINT_NAME), weights_only=True)
    assert saved["step"] == 5 and saved["data_position"]["batch"] == 5
    assert {"model", "optimizer", "scheduler", "rng", "history"} <= set(saved)
    resumed = train_strategy(config, strategy, out_dir=out, checkpoint_every=2, resume=True)
    assert resumed["summary"]["completed"]
    assert _losses(resumed) == _losses(full)
    assert resumed["history"]["edq"] == full["history"]["edq"]
    for (name, a), b in zip(full["model"].state_dict().items(),
                            resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name


def test_resume_refuses_other_settings(tmp_path):
    config = micro_config()
    train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0, stop_after=2)
    with pytest.raises(UsageError, match="other settings: --lr"):
        train_strategy(config.replace(optim={"lr": 0.5}), "plus", out_dir=str(tmp_path),
                       checkpoint_every=0, resume=True)
    with pytest.raises(UsageError, match="for strategy 'plus', not 'bf16'"):
        train_strategy(config, "bf16", out_dir=str(tmp_path), checkpoint_every=0, resume=True)


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    messages = []
    r = train_strategy(micro_config(), "bf16", out_dir=str(tmp_path), checkpoint_every=0,
                       resume=True, log=messages.append)
    assert r["summary"]["completed"] and "starting bf16 at step 0" in messages[0]
    assert os.path.exists(tmp_path / CHECKPOINT_NAME)


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    save_atomic({"step": 1, "w": torch.ones(3)}, path)

    def broken_save(obj, handle, *args, **kwargs):
        handle.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomic({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    kept = torch.load(path, weights_only=True)
    assert kept["step"] == 1 and torch.equal(kept["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ck.pt"], "no temporary file is left behind"


def test_keyboard_interrupt_leaves_a_resumable_checkpoint(tmp_path):
    config = micro_config(run={"steps": 6, "track_every": 0})
    full = train_strategy(config, "plus")

    count = [0]

    def interrupt_after_three(n):
        count[0] += n
        if count[0] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0,
                       progress=interrupt_after_three)
    saved = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)
    assert saved["step"] == 3
    resumed = train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0,
                             resume=True)
    assert resumed["history"]["train_loss"] == full["history"]["train_loss"]
    assert resumed["history"]["val_loss"] == full["history"]["val_loss"]


def test_keyboard_interrupt_during_forward_redoes_the_step(tmp_path, monkeypatch):
    config = micro_config(run={"steps": 6, "track_every": 0, "eval_every": 10})
    full = train_strategy(config, "plus")
    import collage.train.runner as runner

    calls = {"n": 0}
    real = runner.token_loss

    def interrupting_loss(*args, **kwargs):
        if kwargs.get("reduction", "mean") == "mean":  # a training step, not evaluation
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyboardInterrupt  # inside the 4th training step, before its update
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "token_loss", interrupting_loss)
    with pytest.raises(KeyboardInterrupt):
        train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0)
    monkeypatch.undo()
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["step"] == 3
    resumed = train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0,
                             resume=True)
    assert resumed["history"]["train_loss"] == full["history"]["train_loss"]


@pytest.mark.parametrize("second", [False, True], ids=["once", "twice"])
def test_ctrl_c_during_the_update_checkpoints_the_step_once_recorded(tmp_path, monkeypatch,
                                                                     second):
    """A SIGINT delivered while the 3rd step updates (after ``optimizer.step()``, before
    its record: nothing consistent to save) is held until the step is recorded, then
    raised: the checkpoint is of step 3 and the resumed run is the uninterrupted one, bit
    for bit. A second SIGINT in that window raises at once, and no checkpoint is written
    (the run had none yet). The handler is Python's again afterwards."""
    import signal

    import collage.train.runner as runner

    config = micro_config(run={"steps": 6, "track_every": 0})
    full = train_strategy(config, "plus")
    real = runner._record_step

    def interrupted_record(s, step, *args, **kwargs):
        if step == 2:  # the 3rd step, its weights already updated
            for _ in range(2 if second else 1):
                os.kill(os.getpid(), signal.SIGINT)
        return real(s, step, *args, **kwargs)

    monkeypatch.setattr(runner, "_record_step", interrupted_record)
    with pytest.raises(KeyboardInterrupt):
        train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if second:
        assert not (tmp_path / CHECKPOINT_NAME).exists()
        return
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["step"] == 3
    resumed = train_strategy(config, "plus", out_dir=str(tmp_path), checkpoint_every=0,
                             resume=True)
    assert resumed["history"]["train_loss"] == full["history"]["train_loss"]
    assert resumed["history"]["val_loss"] == full["history"]["val_loss"]


@pytest.mark.slow
def test_killed_process_resumes_exactly(tmp_path):
    """SIGKILL a real `collage train` mid-run, resume it, compare with an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    from collage.cli import main

    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--strategy", "plus", "--steps", "400",
            "--eval-every", "50", "--checkpoint-every", "5", "--threads", "1", "--quiet",
            "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "collage", *argv])
    checkpoint = out / CHECKPOINT_NAME
    deadline = time.time() + 300
    while time.time() < deadline:
        if checkpoint.exists() and torch.load(checkpoint, weights_only=True)["step"] >= 20:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stopped_at = torch.load(checkpoint, weights_only=True)["step"]
    assert 20 <= stopped_at < 400
    assert main(argv + ["--resume"]) == 0
    import json

    with open(out / "history.json") as handle:
        resumed = json.load(handle)
    config = micro_config(run={"steps": 400, "eval_every": 50, "threads": 1})
    full = train_strategy(config, "plus")["history"]
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], rel=0, abs=0)
    assert resumed["val_loss"] == full["val_loss"]


def _zero_middle(path, n_bytes: int = 64) -> None:
    """Zero ``n_bytes`` in the middle of ``path``: the damage a bad disk sector does."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(size // 2 - n_bytes // 2)
        before = handle.read(n_bytes)
        assert any(before), "the middle already holds zeros: the test would prove nothing"
        handle.seek(size // 2 - n_bytes // 2)
        handle.write(bytes(n_bytes))


def test_resume_refuses_a_corrupted_checkpoint(tmp_path, capsys):
    """torch.load does not check a tensor's bytes, so 64 zeroed bytes inside one load
    without complaint; the checkpoint's SHA-256 stops the resumption, naming the file."""
    from collage.cli import main

    argv = ["train", "--preset", "micro", "--strategy", "plus", "--steps", "6", "--threads",
            "1", "--quiet", "--out", str(tmp_path)]
    assert main(argv + ["--stop-after", "3"]) == 0
    path = tmp_path / CHECKPOINT_NAME
    _zero_middle(path)
    torch.load(path, weights_only=True)  # still loads: only the digest can tell
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 2
    error = capsys.readouterr().err
    assert f"checkpoint {str(path)!r} is corrupted" in error
    assert error.count("\n") == 1  # one line


def test_checkpoint_digest_covers_every_value(tmp_path):
    payload = {"step": 3, "w": torch.arange(6, dtype=torch.bfloat16), "h": [1.5, math.nan],
               "rng": (3, (1, 2), None)}
    path = str(tmp_path / "ck.pt")
    save_checkpoint(payload, path)
    stored = torch.load(path, weights_only=True)
    assert stored["step"] == 3 and "sha256" in stored  # the layout stays flat
    assert payload_digest({"format": stored.pop("format"), **payload}) == stored["sha256"]
    changed = dict(payload, w=payload["w"].clone())
    changed["w"][5] = 0
    assert payload_digest(changed) != payload_digest(payload)
    assert payload_digest(dict(payload, h=[1.5, 2.0])) != payload_digest(payload)
    assert payload_digest(dict(payload, rng=[3, (1, 2), None])) != payload_digest(payload)


def test_a_checkpoint_from_before_digests_still_resumes(tmp_path):
    """Format 1 (no digest) is read as before: nothing to verify, the settings checked."""
    config = micro_config()
    path = str(tmp_path / CHECKPOINT_NAME)
    save_atomic({"format": 1, "step": 2, "strategy": "plus", "config": config.to_dict()}, path)
    assert load_checkpoint(path, config, "plus")["step"] == 2
    with pytest.raises(UsageError, match="not a collage train checkpoint"):
        save_atomic({"format": 7}, path)
        load_checkpoint(path, config, "plus")
    # another program's file: named ours or not, never torch's advice to load it unsafely
    with open(path, "w") as handle:
        handle.write("not a checkpoint")
    with pytest.raises(UsageError, match="is not a collage train checkpoint: torch.load") as e:
        load_checkpoint(path, config, "plus")
    assert "weights_only=False" not in str(e.value)
