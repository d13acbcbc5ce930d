"""collage compare: every output file, in-process and with one fresh process per strategy."""

from __future__ import annotations

import csv
import json
import os

import pytest

from collage.cli import main
from collage.train.compare import compare

from .conftest import micro_config

FILES = ("results.json", "results.csv", "history.json", "config.json", "report.md",
         "loss.png", "edq.png", "memory.png")
REQUIRED = ("strategy", "final_val_loss", "final_val_ppl", "tokens_per_s",
            "peak_memory_bytes", "edq_mean")


def _check_outputs(out, strategies):
    for name in FILES:
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    for name in ("loss.png", "edq.png", "memory.png"):
        with open(os.path.join(out, name), "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "results.json")) as handle:
        records = json.load(handle)
    assert [r["strategy"] for r in records] == list(strategies)
    for r in records:
        for key in REQUIRED:
            assert r[key] is not None, key
    with open(os.path.join(out, "results.csv")) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["strategy"] for r in rows] == list(strategies)
    with open(os.path.join(out, "report.md")) as handle:
        report = handle.read()
    for needle in ("| strategy |", "torch", "python", "cpu", "collage", "## Settings",
                   "per module family", "peak memory"):
        assert needle in report, needle
    with open(os.path.join(out, "history.json")) as handle:
        history = json.load(handle)
    assert set(history) == set(strategies)
    return records, report


def test_compare_in_process(tmp_path):
    strategies = ("fp32", "bf16", "plus")
    config = micro_config(run={"strategies": strategies, "isolate": False})
    summaries = compare(config, str(tmp_path), log=None)
    records, report = _check_outputs(str(tmp_path), strategies)
    assert len({s["init_checksum"] for s in summaries}) == 1
    assert records[0]["val_loss_vs_fp32"] == 0
    assert "one process for all strategies" in report
    # the allocator measures one step's tensors, so sharing a process does not inflate it
    assert "most bytes held by tensors during one training step (step 2" in report
    assert len({r["peak_memory_bytes"] for r in records}) == 3
    assert [r["bytes_per_param_model"] for r in records] == [16, 8, 12]


def test_compare_fresh_processes_two_at_a_time(tmp_path):
    strategies = ("bf16", "mixed")
    config = micro_config(run={"strategies": strategies, "jobs": 2, "steps": 4,
                               "eval_every": 2})
    compare(config, str(tmp_path), log=None)
    records, report = _check_outputs(str(tmp_path), strategies)
    assert all(r["isolated"] and r["jobs"] == 2 for r in records)
    assert all(r["peak_memory_measured"].startswith("cpu_allocator_events") for r in records)
    assert all(r["threads"] == max(1, len(os.sched_getaffinity(0)) // 2) for r in records)
    assert "fresh process per strategy, 2 at a time" in report
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".init-")]


def test_compare_beta2_sweep_and_cli(tmp_path, capsys):
    out = str(tmp_path / "run")
    rc = main(["compare", "--preset", "micro", "--strategies", "fp32,bf16", "--beta2s",
               "0.95", "0.999", "--steps", "3", "--no-isolate", "--out", out])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fp32 b2=0.95" in printed and "wrote" in printed
    with open(os.path.join(out, "results.json")) as handle:
        records = json.load(handle)
    assert [(r["strategy"], r["beta2"]) for r in records] == [
        ("fp32", 0.95), ("bf16", 0.95), ("fp32", 0.999), ("bf16", 0.999)]
    assert records[3]["val_loss_vs_fp32"] == pytest.approx(
        records[3]["final_val_loss"] / records[2]["final_val_loss"] - 1)


def test_the_report_names_the_validation_batches_it_used(tmp_path):
    """--eval-batches 1000 on a text with room for a few: the report says how many batches
    the validation set has (it said 1000; audit, 2026-12-07)."""
    text = tmp_path / "short.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 700)  # ~30 kB
    config = micro_config(data={"path": str(text)},
                          run={"strategies": ("fp32",), "eval_batches": 1000,
                               "isolate": False})
    compare(config, str(tmp_path / "out"), log=None)
    (record,) = json.loads((tmp_path / "out" / "results.json").read_text())
    used = record["val_batches"]
    assert 1 <= used < 1000
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"on {used} fixed batches" in report and "on 1000 fixed batches" not in report
