"""CSV, JSON-lines and TensorBoard sinks."""

from __future__ import annotations

import csv
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from collage.metrics import CSVWriter, JSONLinesWriter, MetricsCallback, TensorBoardWriter


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_jsonl_lines_are_strict_json_and_flushed_per_write(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JSONLinesWriter(path)
    sink(1, {"edq": 0.1 + 0.2, "imprecision": math.nan})
    # readable before close: flushed per write
    first = path.read_text().splitlines()
    assert first == ['{"step": 1, "edq": 0.30000000000000004, "imprecision": null}']
    sink(2, {"edq": 1.0, "edq/group0": math.inf})
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"step": 1, "edq": 0.30000000000000004, "imprecision": None},
        {"step": 2, "edq": 1.0, "edq/group0": None},
    ]


def test_jsonl_truncates_or_appends(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with JSONLinesWriter(path) as sink:
        sink(1, {"a": 1.0})
    with JSONLinesWriter(path, append=True) as sink:
        sink(2, {"a": 2.0})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    with JSONLinesWriter(path) as sink:
        sink(3, {"a": 3.0})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [3]


def test_csv_header_is_union_of_keys_and_rows_stay_aligned(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    sink = CSVWriter(path)
    sink(0, {"edq": 0.5, "imprecision": 0.25})
    assert _csv_rows(path) == (
        ["step", "edq", "imprecision"],
        [{"step": "0", "edq": "0.5", "imprecision": "0.25"}],
    )
    sink(1, {"edq": 1 / 3, "edq/group0": math.nan})  # new key, imprecision missing
    sink(2, {"imprecision": 1.0})
    sink.close()
    header, rows = _csv_rows(path)
    assert header == ["step", "edq", "imprecision", "edq/group0"] == sink.columns
    assert rows == [
        {"step": "0", "edq": "0.5", "imprecision": "0.25", "edq/group0": ""},
        {"step": "1", "edq": repr(1 / 3), "imprecision": "", "edq/group0": "nan"},
        {"step": "2", "edq": "", "imprecision": "1.0", "edq/group0": ""},
    ]
    assert float(rows[1]["edq"]) == 1 / 3  # full precision round trip
    assert not (tmp_path / "m.csv.tmp").exists()


def test_csv_is_complete_after_each_write(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    sink = CSVWriter(path)
    for step in range(3):
        sink(step, {f"k{step}": float(step)})
        header, rows = _csv_rows(path)
        assert header == ["step"] + [f"k{i}" for i in range(step + 1)]
        assert [r["step"] for r in rows] == [str(i) for i in range(step + 1)]
    sink.close()


def test_a_closed_csv_writer_refuses_every_row(tmp_path: Path) -> None:
    """After ``close()`` a row is refused, one with a new column too (widening the header
    reopened the file and wrote it before), and the file is as it was closed."""
    path = tmp_path / "m.csv"
    sink = CSVWriter(path)
    sink(0, {"a": 1.0})
    sink.close()
    closed = path.read_text()
    for metrics in ({"a": 2.0}, {"a": 2.0, "new": 3.0}):
        with pytest.raises(ValueError, match="is closed"):
            sink(1, metrics)
    assert path.read_text() == closed


def test_csv_append_keeps_existing_header(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    with CSVWriter(path) as sink:
        sink(0, {"a": 1.0, "b": 2.0})
    with CSVWriter(path, append=True) as sink:
        assert sink.columns == ["step", "a", "b"]
        sink(1, {"b": 3.0, "c": 4.0})
    header, rows = _csv_rows(path)
    assert header == ["step", "a", "b", "c"]
    assert rows == [
        {"step": "0", "a": "1.0", "b": "2.0", "c": ""},
        {"step": "1", "a": "", "b": "3.0", "c": "4.0"},
    ]


@pytest.mark.parametrize("header", ["edq\n0.5\n", "edq,step\n0.5,1\n"])
def test_csv_append_refuses_a_file_it_did_not_write(tmp_path: Path, header: str) -> None:
    """A header without ``step`` first: its rows would not line up with ours (an audit found
    ``edq\\n0.5\\n7,0.9`` written, 2026-12-07). Refused, and the file left as it was."""
    path = tmp_path / "m.csv"
    path.write_text(header)
    with pytest.raises(ValueError, match="does not start with the 'step' column"):
        CSVWriter(path, append=True)
    assert path.read_text() == header


def _fake_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeSummaryWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)


@pytest.mark.parametrize("cls", [CSVWriter, JSONLinesWriter, TensorBoardWriter])
def test_step_is_a_reserved_name(tmp_path: Path, cls: type,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tensorboard(monkeypatch)
    with cls(tmp_path / "m.out") as sink:
        with pytest.raises(ValueError, match="reserved"):
            sink(0, {"step": 1.0})


def test_tensorboard_missing_gives_a_clear_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardWriter(tmp_path / "tb")


class _FakeSummaryWriter:
    """Records what TensorBoardWriter does with a SummaryWriter."""

    instances: list[_FakeSummaryWriter] = []

    def __init__(self, log_dir: str, **kwargs: Any) -> None:
        self.log_dir, self.kwargs = log_dir, kwargs
        self.events: list[tuple[Any, ...]] = []
        _FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.events.append(("scalar", tag, value, global_step))

    def flush(self) -> None:
        self.events.append(("flush",))

    def close(self) -> None:
        self.events.append(("close",))


def test_tensorboard_writes_scalars_and_flushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_tensorboard(monkeypatch)
    with TensorBoardWriter(tmp_path / "tb", flush_secs=5) as sink:
        sink(7, {"edq": 0.9, "edq/group0": 1.0})
    writer = _FakeSummaryWriter.instances[-1]
    assert writer.log_dir == str(tmp_path / "tb") and writer.kwargs == {"flush_secs": 5}
    assert writer.events == [
        ("scalar", "edq", 0.9, 7),
        ("scalar", "edq/group0", 1.0, 7),
        ("flush",),
        ("close",),
    ]


def test_sinks_satisfy_the_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeSummaryWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    sinks = [
        CSVWriter(tmp_path / "a.csv"),
        JSONLinesWriter(tmp_path / "a.jsonl"),
        TensorBoardWriter(tmp_path / "tb"),
    ]
    for sink in sinks:
        assert isinstance(sink, MetricsCallback)
        sink.close()
    assert not isinstance(object(), MetricsCallback)
