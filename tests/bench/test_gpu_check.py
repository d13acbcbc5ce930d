"""``benchmarks/gpu_check.sh``'s CPU-only parts: its arguments, the commands it would run
(``--dry-run``: the test selection, the benchmarks' flags, the time limits), and the goals
read off results (``benchmarks/gpu_goals.py``), "not measured" where a result is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_script_is_executable():
    assert os.access(SCRIPT, os.X_OK)


def test_out_is_required():
    done = _run()
    assert done.returncode == 2 and "OUT is required" in done.stderr


@pytest.mark.parametrize("args", [("--bogus", "out"), ("a", "b")])
def test_bad_arguments_are_refused(args):
    assert _run(*args).returncode == 2


def test_dry_run_prints_the_stages_and_runs_nothing(tmp_path):
    out = tmp_path / "results"
    done = _run("--dry-run", str(out))
    assert done.returncode == 0, done.stderr
    assert not out.exists()  # nothing ran, nothing was written
    stages = re.findall(r"^\[(\w+)\] timeout (\d+)s: (.*)$", done.stdout, re.M)
    assert [s[0] for s in stages] == ["install", "tests", "bench_optimizer", "bench_train",
                                      "model", "goals"]
    assert sum(int(s[1]) for s in stages) <= 8 * 60 - 30  # 8 minutes, with slack
    commands = {name: command for name, _, command in stages}
    assert '-m "cuda or triton"' in commands["tests"]
    assert "gpu_model.py --arch auto" in commands["model"]
    bench = commands["bench_optimizer"]
    assert "--device cuda" in bench and "--size 16m,100m,1b" in bench
    assert "torch-fused-bf16" in bench and "optimi-kahan" in bench and "torchao-sr" in bench
    assert "--device cuda" in commands["bench_train"]
    assert "--d-model 768" in commands["bench_train"]
    assert str(out) in bench  # results under OUT, as an absolute path


def test_the_selected_tests_exist_and_are_marked():
    """The selection finds the interpreter tests and the CUDA matrix (collected, not run)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m",
                           "cuda or triton", "tests/optim/test_triton.py",
                           "tests/optim/test_triton_cuda.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-2000:]
    assert "test_triton.py::" in done.stdout and "test_triton_cuda.py::" in done.stdout


def _goals_module():
    spec = importlib.util.spec_from_file_location("gpu_goals",
                                                  ROOT / "benchmarks" / "gpu_goals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(strategy: str, speedup: float, roofline: float, first: float) -> dict:
    return {"key": f"collage:{strategy}:fused", "path": "fused", "strategy": strategy,
            "speedup_vs_torch_fused": speedup, "roofline_fraction": roofline,
            "first_step_s": first}


def test_goals_read_off_results(tmp_path):
    module = _goals_module()
    optimizer = {"environment": {"gpu": "Some GPU"}, "sizes": [
        {"size": "16m", "rows": [_row("light", 1.1, 0.5, 7.0)]},  # below 100M: not counted
        {"size": "100m", "rows": [_row("light", 1.6, 0.9, 0.1), _row("plus", 1.2, 0.8, 0.1),
                                  # without the check: not the default, not a goal's figure
                                  {**_row("plus", 9.0, 0.99, 0.1),
                                   "key": "collage:plus:fused+ignore"}]},
        {"size": "1b", "rows": [_row("light", 1.7, 0.92, 0.1), _row("plus", 1.3, 0.88, 0.1)]},
    ]}
    (tmp_path / "bench_optimizer.json").write_text(json.dumps(optimizer))
    found = {g["goal"]: g for g in module.goals(optimizer, None)}
    light = found["light step speed vs torch fused AdamW fp32 (100M+)"]
    plus = found["plus step speed vs torch fused AdamW fp32 (100M+)"]
    assert (light["value"], light["holds"]) == (1.6, True)
    assert (plus["value"], plus["holds"]) == (1.2, False)  # the worst size counts
    assert found["plus fraction of the HBM roofline (100M+)"]["holds"] is False
    assert found["first step, kernels compiled (s)"]["value"] == 7.0
    assert found["train: plus peak memory vs autocast"]["value"] is None
    # no loop measurements (a CPU run, or an older bench): "not measured", never estimated
    looped = found["light step speed vs torch fused AdamW fp32 (100M+), steps in a loop"]
    assert looped["value"] is None and looped["holds"] is None
    script = str(ROOT / "benchmarks" / "gpu_goals.py")
    done = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert "Some GPU" in done.stdout and "not measured" in done.stdout


def test_the_loop_goal_reads_the_loop_ratio_at_the_worst_size():
    module = _goals_module()
    optimizer = {"sizes": [
        {"size": "100m", "rows": [{**_row("light", 0.9, 0.5, 0.1),
                                   "loop_speedup_vs_torch_fused": 1.55}]},
        {"size": "1b", "rows": [{**_row("light", 1.6, 0.9, 0.1),
                                 "loop_speedup_vs_torch_fused": 1.7}]},
    ]}
    found = {g["goal"]: g for g in module.goals(optimizer, None)}
    isolated = found["light step speed vs torch fused AdamW fp32 (100M+)"]
    looped = found["light step speed vs torch fused AdamW fp32 (100M+), steps in a loop"]
    assert (isolated["value"], isolated["holds"]) == (0.9, False)
    assert (looped["value"], looped["holds"]) == (1.55, True)


def test_no_results_is_not_measured(tmp_path):
    module = _goals_module()
    text = module.markdown(module.goals(None, None), "no GPU result")
    assert text.count("not measured") >= 2 * 5 and "yes" not in text


def test_goals_print_the_model_s_prediction_beside_the_measurement(tmp_path):
    """With ``gpu_model.json`` beside the results, each step goal gets the model's figure:
    the fraction (the worse size) and the speed-up from bytes / fraction against the
    calibration kernel's; without it, "not modelled"."""
    module = _goals_module()
    optimizer = {"sizes": [{"size": "1b", "rows": [_row("light", 1.4, 0.8, 0.1)]}]}
    model = [{"rule": "adamw", "strategy": "light", "configuration": "default",
              "variant": "whole", "bytes_per_element": 18, "predicted_1b": 0.9,
              "predicted_100m": 0.6},
             {"rule": "-", "strategy": "plain fp32 AdamW", "configuration": "calibration",
              "variant": "whole", "bytes_per_element": 28, "predicted_1b": 0.7,
              "predicted_100m": 0.7}]
    found = {g["goal"]: g for g in module.goals(optimizer, None, model)}
    assert found["light fraction of the HBM roofline (100M+)"]["predicted"] == 0.6
    speed = found["light step speed vs torch fused AdamW fp32 (100M+)"]["predicted"]
    assert speed == pytest.approx((28 / 0.7) / (18 / 0.6))
    assert found["plus step speed vs torch fused AdamW fp32 (100M+)"]["predicted"] is None
    text = module.markdown(list(found.values()), "GPU")
    assert "not modelled" in text and "0.6 |" in text
