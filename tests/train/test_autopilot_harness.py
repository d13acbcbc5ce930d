"""The autopilot (``strategy="auto"``) in the harness: ``collage compare`` and ``collage
memory`` know it; the report says what was promoted and when, and plots bytes per
parameter over training; a resumed run keeps its decisions."""

from __future__ import annotations

import json
import os

from collage.cli import main
from collage.optim import AUTO
from collage.optim.strategies import NAMES
from collage.train.compare import compare

from .conftest import micro_config


def test_compare_runs_auto_and_reports_its_promotions(tmp_path):
    config = micro_config(run={"strategies": (NAMES.bf16, AUTO), "isolate": False,
                               "steps": 6, "eval_every": 3, "track_every": 2},
                          optim={"auto_every": 2, "auto_threshold": 0.25})
    compare(config, str(tmp_path), log=None)
    with open(os.path.join(tmp_path, "results.json")) as handle:
        records = {r["strategy"]: r for r in json.load(handle)}
    auto = records[AUTO]
    decisions = auto["auto_decisions"]
    assert decisions, "the micro run promotes its norm gains (lost updates at 1.0)"
    assert {d["old"] for d in decisions} <= {NAMES.bf16, NAMES.light}
    assert all(d["step"] % 2 == 0 and d["lost"] > 0.25 for d in decisions)
    assert 8 < auto["auto_bytes_per_param_final"] <= 12
    assert auto["auto_bytes_per_param_peak"] == auto["auto_bytes_per_param_final"]
    assert auto["bytes_per_param_model"] == round(auto["auto_bytes_per_param_final"], 2)
    # measured at the end (its rungs then): the memory model's figure, within the
    # few bytes of the step counters
    assert abs(auto["bytes_per_param_measured"] - auto["auto_bytes_per_param_final"]) < 0.1
    assert records[NAMES.bf16]["bytes_per_param_model"] == 8
    with open(os.path.join(tmp_path, "report.md")) as handle:
        report = handle.read()
    assert "## Autopilot: what was promoted, and when" in report
    assert "norm: " in report and "light@1" in report
    with open(os.path.join(tmp_path, "auto_bytes.png"), "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(tmp_path, "history.json")) as handle:
        history = json.load(handle)[AUTO]
    assert history["auto_step"] == [1, 3, 5]  # after the steps 0, 2 and 4 that decided


def test_memory_knows_auto(capsys):
    assert main(["memory", "--params", "1e9", "--strategy", f"{AUTO},{NAMES.light}"]) == 0
    out = capsys.readouterr().out
    assert "auto: each tensor at a rung" in out
    assert "bf16 8 -> light 10 -> plus 12 bytes per parameter, 8.00 to 12.00 GB" in out
    assert main(["memory", "--params", "1e9"]) == 0  # the default table: no auto row
    assert "\nauto " not in capsys.readouterr().out
