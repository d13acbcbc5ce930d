"""Logging sinks for flat ``{name: float}`` metrics dicts (e.g. :meth:`UpdateStats.to_dict`).

Every sink is a :class:`MetricsCallback`: call it with ``(step, metrics)`` and ``close()`` it
at the end (or use it as a context manager). Files are flushed after every write, so a
crashed run keeps everything logged so far.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

__all__ = ["CSVWriter", "JSONLinesWriter", "MetricsCallback", "TensorBoardWriter"]

_STEP = "step"


@runtime_checkable
class MetricsCallback(Protocol):
    """Anything that receives ``(step, metrics)`` once per logging step and can be closed."""

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` (flat name -> value) for optimizer step ``step``."""

    def close(self) -> None:
        """Flush and release resources; no call is allowed afterwards."""


def _check_metrics(metrics: Mapping[str, float]) -> None:
    """Reject a metric named like the reserved ``step`` column."""
    if _STEP in metrics:
        raise ValueError(f"metric name {_STEP!r} is reserved for the step number")


class _Sink:
    """Context-manager support shared by the sinks."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> _Sink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class JSONLinesWriter(_Sink):
    """One JSON object per line: ``{"step": 10, "edq": 0.98, ...}``.

    Each line is strict JSON (RFC 8259): non-finite values (an undefined ``edq`` is nan) are
    written as ``null``. Keys may differ from line to line. ``append=False`` truncates an
    existing file.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        _check_metrics(metrics)
        record: dict[str, Any] = {_STEP: int(step)}
        for name, value in metrics.items():
            v = float(value)
            record[name] = v if math.isfinite(v) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class CSVWriter(_Sink):
    """A CSV file with a ``step`` column and one column per metric name seen so far.

    The header is always the union of all keys seen, in order of first appearance. When a
    call brings a new key, the file is rewritten once (read back, written to a temporary
    file with the wider header, atomically renamed) and older rows get empty cells for the
    new columns; rows missing a known key get an empty cell too. Rewrites cost O(file size)
    but only happen when the key set grows, normally within the first logging step. Values
    are written with full float precision (``nan``/``inf`` as such). ``append=True``
    continues an existing file, keeping its header; a file whose header does not start with
    ``step`` (not written by this class) is refused.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        self._columns: list[str] = [_STEP]
        if append and self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [_STEP])
            if header[:1] != [_STEP] or header.count(_STEP) != 1:
                raise ValueError(
                    f"CSVWriter({str(self.path)!r}, append=True): the file's header "
                    f"{header} does not start with the {_STEP!r} column, so it was not "
                    "written by CSVWriter and its rows would not line up: append to a file "
                    "CSVWriter wrote, or pass append=False to start it anew")
            self._columns = header
            self._file = open(self.path, "a", newline="", encoding="utf-8")
        else:
            self._file = open(self.path, "w", newline="", encoding="utf-8")
            self._write_header(self._file)

    @property
    def columns(self) -> list[str]:
        """The current header (``step`` first)."""
        return list(self._columns)

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file.closed:  # (a new column would reopen the file: refused as any row)
            raise ValueError(f"CSVWriter({str(self.path)!r}) is closed: open a new one, "
                             "with append=True to continue the file")
        _check_metrics(metrics)
        new = [name for name in metrics if name not in self._columns]
        if new:
            self._widen(new)
        row = {_STEP: str(int(step))}
        row.update({name: repr(float(value)) for name, value in metrics.items()})
        self._writer(self._file).writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _writer(self, file: Any) -> csv.DictWriter[str]:
        return csv.DictWriter(file, fieldnames=self._columns, restval="")

    def _write_header(self, file: Any) -> None:
        self._writer(file).writeheader()
        file.flush()

    def _widen(self, new: list[str]) -> None:
        """Add columns ``new``: rewrite the file with the wider header, then reopen it."""
        self._file.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        self._columns = self._columns + new
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = self._writer(f)
            writer.writeheader()
            writer.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")


class TensorBoardWriter(_Sink):
    """Scalars to TensorBoard: ``add_scalar(name, value, step)`` per metric, flushed per call.

    Names with a ``/`` (``edq/group0``) are grouped by TensorBoard under their prefix.
    Needs the ``tensorboard`` package (imported lazily, here).
    """

    def __init__(self, log_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "TensorBoardWriter needs the tensorboard package: pip install tensorboard"
            ) from exc
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), **kwargs)

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        _check_metrics(metrics)
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
