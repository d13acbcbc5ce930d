"""benchmarks/combine_runs.py: medians over runs of each row, same-run ratios kept per run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "combine_runs.py"


def _module():
    spec = importlib.util.spec_from_file_location("combine_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(ns: float, speedup: float, roofline: float, copy: float) -> dict:
    row = {"label": "collage plus (fused, native)", "bytes_per_param": 22,
           "ns_per_param": {"median": ns}, "roofline_fraction": roofline,
           "speedup_vs_torch_fused": speedup, "speedup_vs_torch_fused_cpu": speedup + 0.5}
    return {"sizes": [{"size": "16m", "n_params": 17_067_008, "n_tensors": 52,
                       "copy_GBps": copy, "add_GBps": 2 * copy, "rows": [row]}]}


def test_combine_takes_medians_over_runs_and_lists_each_runs_ratio() -> None:
    runs = [_run(0.6, 1.10, 0.70, 30), _run(0.4, 1.30, 0.90, 40), _run(0.5, 1.20, 0.80, 50)]
    table = _module().combine(runs)
    assert "#### 16m: 17.07M parameters, 52 tensors" in table
    assert "30 / 60, 40 / 80, 50 / 100 GB/s" in table
    # ns 0.5, roofline 80 %, ratios in run order, their median 1.20, CPU-time median 1.70
    assert ("| collage plus (fused, native) | 22 | 0.5 | 80% | 1.10 / 1.30 / 1.20 | **1.20** "
            "| 1.70 |") in table


def test_combine_refuses_runs_of_different_sizes() -> None:
    other = _run(0.5, 1.2, 0.8, 40)
    other["sizes"][0]["size"] = "100m"
    with pytest.raises(ValueError, match="differ in their sizes"):
        _module().combine([_run(0.5, 1.2, 0.8, 40), other])


def test_combine_says_which_runs_started_on_a_busy_machine() -> None:
    runs = [_run(0.6, 1.10, 0.70, 30), _run(0.4, 1.30, 0.90, 40), _run(0.5, 1.20, 0.80, 50)]
    runs[0]["load"] = {"before": [0.12, 0.2, 0.3], "busy": False}
    runs[1]["load"] = {"before": [2.71, 2.0, 1.0], "busy": True}
    table = _module().combine(runs)
    assert table.startswith("1-minute load average before each run: 0.12, 2.71 (busy: times "
                            "not the machine's), not recorded\n")
    assert "load" not in _module().combine([_run(0.5, 1.2, 0.8, 40)])
