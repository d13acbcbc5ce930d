"""The runs of one ``collage compare``: every (beta2, learning rate, strategy, seed), and,
with ``--resume``, each run's own directory under ``--out/runs/``.

A run's directory holds its checkpoint while it trains (``collage.train.checkpoint``) and
``result.json`` (summary, history, the configuration it ran) once it finished; then the
checkpoint is deleted (a study of many runs would otherwise keep gigabytes of optimizer
states). A run whose ``result.json`` exists is not trained again, so re-running the same
command after an interruption continues where it stopped, and adding seeds or strategies to
a finished comparison trains only the new runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from .checkpoint import CHECKPOINT_NAME, config_differences
from ..optim import AUTO
from .config import Config, OptimConfig

__all__ = ["Run", "RESULT_NAME", "plan_runs", "run_config", "run_dir", "load_result",
           "save_result", "training_lock"]

RESULT_NAME = "result.json"
RUNS_DIR = "runs"
LOCK_NAME = ".lock"


@dataclass(frozen=True)
class Run:
    """One training run. ``cell`` names the runs that differ only by seed (what the
    statistics over seeds pool); ``label`` adds the seed when there are several."""

    strategy: str
    beta2: float
    lr: float
    seed: int
    cell: str
    label: str

    @property
    def key(self) -> str:
        """The name of the run's directory: every coordinate, whatever the labels omit."""
        return f"{self.strategy}_b2-{self.beta2:g}_lr-{self.lr:g}_seed-{self.seed}"


def _learning_rates(config: Config, strategy: str) -> tuple[float, ...]:
    """The peak learning rates ``strategy`` runs at: every ``--lrs`` value if it is swept
    (``--lrs-strategies``, default all), else ``--lr``."""
    run = config.run
    if run.lrs and (not run.lrs_strategies or strategy in run.lrs_strategies):
        return run.lrs
    return (config.optim.lr,)


def plan_runs(config: Config) -> list[Run]:
    """Every run, ordered by beta2, learning rate, strategy (in the order given), seed."""
    run = config.run
    beta2s = run.beta2s or (config.optim.beta2,)
    seeds = tuple(range(run.seed, run.seed + run.seeds))
    strategies = run.strategy_list()
    by_strategy = {s: _learning_rates(config, s) for s in strategies}
    lrs = sorted({lr for values in by_strategy.values() for lr in values})
    runs = []
    for beta2 in beta2s:
        for lr in lrs:
            for strategy in (s for s in strategies if lr in by_strategy[s]):
                cell = " ".join([strategy] + ([f"b2={beta2:g}"] if len(beta2s) > 1 else [])
                                + ([f"lr={lr:g}"] if len(lrs) > 1 else []))
                for seed in seeds:
                    label = f"{cell} seed={seed}" if len(seeds) > 1 else cell
                    runs.append(Run(strategy, beta2, lr, seed, cell, label))
    return runs


def run_config(config: Config, run: Run) -> Config:
    """The configuration ``run`` trains with: its seed, learning rate and beta2 set; the
    autopilot's settings at their defaults unless it runs ``auto`` (so that a run of
    another strategy is the same run, resumable, whatever ``--auto-*`` say)."""
    auto = {} if run.strategy == AUTO else {
        name: getattr(OptimConfig, name) for name in ("auto_threshold", "auto_every")}
    return config.replace(run={"seed": run.seed},
                          optim={"lr": run.lr, "beta2": run.beta2, **auto})


def run_dir(out_dir: str, run: Run) -> str:
    return os.path.join(out_dir, RUNS_DIR, run.key)


@contextlib.contextmanager
def training_lock(directory: str) -> Iterator[None]:
    """Hold the run's lock while it trains: a second ``collage compare`` on the same
    ``--out`` (say, restarted while an orphaned child of the first still trains) stops with
    a UsageError instead of writing the same checkpoint at the same time. ``flock`` locks
    die with their process, so a killed run leaves none held (its empty file stays, and the
    next holder takes it). The holder removes the file as it lets go, so a finished run's
    directory keeps no ``.lock``; a process that opened the file before that removal and
    locks it after finds it no longer at its path (``_holds``) and locks the path's new
    file instead, so two processes never both hold the run."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    while True:
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise UsageError(f"--resume: {directory!r} is being trained by another process; "
                             "wait for it or stop it first") from None
        if _holds(handle, path):
            break
        handle.close()  # the file its holder removed: lock the one at the path now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # the directory removed meanwhile
            os.unlink(path)  # while still held: see above
        handle.close()


def _holds(handle, path: str) -> bool:
    """Whether the open file ``handle`` is still the file at ``path``."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def save_result(directory: str, config: Config, result: dict[str, Any]) -> None:
    """Record a finished run (written to a temporary name, then renamed: a reader sees a
    whole file or none) and delete its checkpoint."""
    path = os.path.join(directory, RESULT_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        # NaN stays NaN (json's default): the loaded result equals the one returned
        json.dump({"config": config.to_dict(), **result}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    checkpoint = os.path.join(directory, CHECKPOINT_NAME)
    if os.path.exists(checkpoint):
        os.unlink(checkpoint)


def load_result(directory: str, config: Config) -> dict[str, Any] | None:
    """The finished result in ``directory`` (``{"summary", "history"}``), None when the run
    has not finished; a UsageError when it was made with other settings."""
    path = os.path.join(directory, RESULT_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as handle:
            stored = json.load(handle)
        diffs = config_differences(stored["config"], config.to_dict())
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--resume: cannot read {path!r} ({error}); delete it to train the "
                         "run again") from None
    if diffs:
        raise UsageError(f"--resume: {path!r} was made with other settings: "
                         + "; ".join(diffs[:3]) + "; use another --out")
    return {"summary": stored["summary"], "history": stored["history"]}
