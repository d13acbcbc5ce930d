"""Checkpoints of ``collage train``: written atomically, verified, read back only for the
same run.

A checkpoint holds everything of a run that evolves (weights, optimizer and scheduler
state, RNG states, the history so far, the timing counters); the data position is the
step itself (``collage.train.data``), so a resumed run continues bit for bit.

It also holds a SHA-256 of its payload (:func:`payload_digest`: every tensor's dtype,
shape and bytes, every other value's type and ``repr``, in order), computed before the
write and again after the read. ``torch.load`` does not check the bytes of a tensor (its
zip records' CRCs are not verified), so a file damaged on disk would otherwise resume
with silently wrong weights; with the digest it stops with an error naming the file.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from typing import Any

import torch

from ..errors import UsageError
from .config import Config

__all__ = ["CHECKPOINT_NAME", "CHECKPOINT_FORMAT", "save_atomic", "save_checkpoint",
           "load_checkpoint", "payload_digest", "config_differences", "rng_state",
           "set_rng_state"]

CHECKPOINT_NAME = "checkpoint.pt"
#: 2: with the payload's SHA-256 (1: without; still read, with nothing to verify)
CHECKPOINT_FORMAT = 2
# Run fields that may differ between an interrupted run and its resumption (for compare:
# between the command that made a run and the one that reuses it).
# Not ``eval_batches``: another validation set makes a reused run's losses incomparable.
RESUMABLE_RUN_FIELDS = ("resume", "stop_after", "quiet", "out", "checkpoint_every", "threads",
                        "eval_every", "isolate", "strategies", "beta2s", "jobs", "nproc",
                        "seeds", "lrs", "lrs_strategies", "report_only")


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


def _digest_into(h: Any, obj: Any) -> None:
    """Feed ``obj`` to the hash ``h``: containers by their items in order, a tensor by its
    dtype, shape and bytes, anything else by its type and ``repr`` (exact for the ints,
    floats, strings and dtypes a checkpoint holds)."""
    if isinstance(obj, torch.Tensor) and hasattr(obj, "__tensor_flatten__"):
        # a wrapper subclass (torchao's 8-bit states: codes, scale, map) has no bytes of
        # its own to view: its inner tensors and its context, by torch's flatten protocol
        names, context = obj.__tensor_flatten__()
        h.update(f"{type(obj).__qualname__} {tuple(obj.shape)} {context!r}|".encode())
        for name in names:
            _digest_into(h, getattr(obj, name))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"dict {len(obj)}|".encode())
        for key, value in obj.items():
            _digest_into(h, key)
            _digest_into(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__} {len(obj)}|".encode())
        for value in obj:
            _digest_into(h, value)
    else:
        h.update(f"{type(obj).__name__} {obj!r}|".encode())


def payload_digest(payload: Any) -> str:
    """The SHA-256 of a checkpoint's content (not of its file: equal before the write and
    after the read, whatever torch's file layout)."""
    h = hashlib.sha256()
    _digest_into(h, payload)
    return h.hexdigest()


def save_checkpoint(payload: dict[str, Any], path: str) -> None:
    """``payload`` with its format and, last, the digest of both, written atomically
    (:func:`save_atomic`). The layout stays flat (``torch.load(path)["step"]`` works)."""
    record = {"format": CHECKPOINT_FORMAT, **payload}
    record["sha256"] = payload_digest(record)
    save_atomic(record, path)


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


def config_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings (as flags) in which the configuration ``current`` differs from the
    ``stored`` one of a checkpoint or a finished run, leaving out those a resumed run may
    change (:data:`RESUMABLE_RUN_FIELDS`)."""
    a, b = _comparable(stored), _comparable(current)
    out = []
    for section in a:
        if isinstance(a[section], dict):
            for key in a[section]:
                value = b.get(section, {}).get(key)
                if _normal(a[section][key]) != _normal(value):
                    out.append(f"--{key.replace('_', '-')} {value} "
                               f"(checkpoint: {a[section][key]})")
    return out


def _normal(value: Any) -> Any:
    """A setting as JSON gives it back (tuples become lists), so that a configuration read
    from a file compares equal to the one it was written from."""
    return list(value) if isinstance(value, tuple) else value


def _read(path: str) -> dict[str, Any]:
    """The checkpoint's payload, its digest verified; one UsageError naming the file for a
    file that does not load, is not ours, or whose content changed since it was written."""
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as error:
        raise UsageError(f"--resume: cannot read checkpoint {path!r}: "
                         f"{error.strerror or error}") from None
    except Exception:  # (torch's text would advise weights_only=False: never for ours)
        raise UsageError(f"--resume: {path!r} is not a collage train checkpoint: torch.load "
                         "cannot read it with weights_only=True, as it reads every checkpoint "
                         "collage writes (a damaged file, or another program's); delete it "
                         "to start afresh") from None
    if not isinstance(stored, dict) or stored.get("format") not in (1, CHECKPOINT_FORMAT):
        raise UsageError(f"--resume: {path!r} is not a collage train checkpoint")
    if stored["format"] == 1:  # written before checkpoints carried a digest
        return stored
    recorded = stored.pop("sha256", None)  # the rest, in order, is what was digested
    if payload_digest(stored) != recorded:
        raise UsageError(f"--resume: checkpoint {path!r} is corrupted: its content does not "
                         "match the SHA-256 recorded when it was written; delete it to start "
                         "afresh, or restore it from a copy")
    return stored


def load_checkpoint(path: str, config: Config, strategy: str) -> dict[str, Any]:
    """A checkpoint written by this module for the same configuration and strategy, its
    digest verified."""
    payload = _read(path)
    if payload["strategy"] != strategy:
        raise UsageError(f"--resume: the checkpoint in {path!r} is for strategy "
                         f"{payload['strategy']!r}, not {strategy!r}")
    diffs = config_differences(payload["config"], config.to_dict())
    if diffs:
        raise UsageError(f"--resume: the checkpoint in {path!r} was made with other settings: "
                         + "; ".join(diffs[:3]))
    return payload
