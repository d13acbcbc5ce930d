"""Checkpoints of ``collage train``: written atomically, read back only for the same run.

A checkpoint holds everything of a run that evolves (weights, optimizer and scheduler
state, RNG states, the history so far, the timing counters); the data position is the
step itself (``collage.train.data``), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import torch

from ..errors import UsageError
from .config import Config

__all__ = ["CHECKPOINT_NAME", "CHECKPOINT_FORMAT", "save_atomic", "load_checkpoint",
           "rng_state", "set_rng_state"]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
# Run fields that may differ between an interrupted run and its resumption.
RESUMABLE_RUN_FIELDS = ("resume", "stop_after", "quiet", "out", "checkpoint_every", "threads",
                        "eval_every", "eval_batches", "isolate", "strategies", "beta2s",
                        "jobs", "nproc")


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then ``os.replace``:
    ``path`` holds either the previous complete file or the new one, never a partial one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _sync_directory(directory)


def _sync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (where the platform allows it)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def rng_state() -> dict[str, Any]:
    """The generators a training step draws from (dropout, masking): torch's, Python's and,
    once CUDA is in use, every CUDA device's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _comparable(config_dict: dict[str, Any]) -> dict[str, Any]:
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in config_dict.items()}
    for name in RESUMABLE_RUN_FIELDS:
        d["run"].pop(name, None)
    d.pop("preset", None)
    return d


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for section in a:
        if isinstance(a[section], dict):
            for key in a[section]:
                if a[section][key] != b.get(section, {}).get(key):
                    out.append(f"--{key.replace('_', '-')} {b.get(section, {}).get(key)} "
                               f"(checkpoint: {a[section][key]})")
    return out


def load_checkpoint(path: str, config: Config, strategy: str) -> dict[str, Any]:
    """A checkpoint written by this module for the same configuration and strategy."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"--resume: cannot read checkpoint {path!r}: "
                         f"{str(error).splitlines()[0] if str(error) else error!r}") from None
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume: {path!r} is not a collage train checkpoint")
    if payload["strategy"] != strategy:
        raise UsageError(f"--resume: the checkpoint in {path!r} is for strategy "
                         f"{payload['strategy']!r}, not {strategy!r}")
    diffs = _differences(_comparable(payload["config"]), _comparable(config.to_dict()))
    if diffs:
        raise UsageError(f"--resume: the checkpoint in {path!r} was made with other settings: "
                         + "; ".join(diffs[:3]))
    return payload
