"""benchmarks/check_cost.py: the policy switch reaches the step (the check runs on the
"skip" steps only, once each: a planned step's inside its one C call) and the counted
check is put back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from collage.optim import native
from collage.optim import nonfinite as nonfinite_module
from collage.optim.native import plan as native_plan

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "check_cost.py"


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
def test_check_runs_on_the_skip_steps_only() -> None:
    spec = importlib.util.spec_from_file_location("check_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    check, planned = nonfinite_module.any_nonfinite, native_plan.step_plans
    row = module.measure("small", "plus", rounds=3)
    assert nonfinite_module.any_nonfinite is check and native_plan.step_plans is planned
    assert row["path"] == "native" and row["check_calls"] == row["checks_in_step_call"] == 3
    assert row["skip_ms"] > 0 and row["ignore_ms"] > 0 and row["check_ms"] is None
