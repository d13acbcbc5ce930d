"""The GPU study (``collage compare --preset gpu-study``, ``benchmarks/gpu_study.sh``) on
CPU: its model's size counted without allocating, its plan's arithmetic and that the plan fits
6 minutes by it, ``--dry-run`` (the CLI's and the script's), the model built and run on the
meta device, and the same code path trained for real at a micro size."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from collage.cli import main
from collage.train.presets import GPU_STUDY_STRATEGIES, get_preset
from collage.train.data import vocab_size
from collage.train.models import build_model
from collage.train.sizing import (GPU_STUDY_BUDGET, count_params, flops_per_token,
                                  format_plan, plan_of)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_study.sh"
LIMIT_S = 6 * 60


def _gpt_params(d: int, layers: int, context: int, vocab: int) -> int:
    """GPT-2's parameters in closed form: per block two LayerNorms (4d), attention
    (3d^2 + 3d, d^2 + d) and MLP (4d^2 + 4d, 4d^2 + d); token and position tables, the
    final LayerNorm and an untied head without bias."""
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return layers * block + vocab * d + context * d + 2 * d + d * vocab


def test_the_preset_is_the_issue_s_comparison():
    config = get_preset("gpu-study")
    assert config.run.strategy_list() == GPU_STUDY_STRATEGIES == ("bf16", "mixed", "light",
                                                                  "plus")
    assert config.optim.beta2 == 0.999 and not config.run.beta2s
    assert config.run.seeds == 1 and not config.run.lrs  # same seed, data and schedule
    assert (config.data.path, config.data.tokenizer) == ("stdlib", "bpe")
    assert config.run.device == "cuda" and config.run.track_every > 0


def test_the_model_has_over_100m_parameters_counted_without_allocating():
    config = get_preset("gpu-study")
    m = config.model
    n = count_params(m, vocab_size(config.data))
    assert n == _gpt_params(m.d_model, m.n_layers, m.context, config.data.vocab_size)
    assert n >= 100_000_000


def test_the_model_builds_and_runs_on_the_meta_device():
    """The configuration is valid: the model builds and maps (B, T) ids to (B, T, vocab)
    logits, on the meta device (no memory, no arithmetic)."""
    config = get_preset("gpu-study")
    vocab = vocab_size(config.data)
    # without grad: the recomputed MLP's saved-tensor hook asks autocast about the device,
    # which knows no "meta"; the forward's shapes are the same either way
    with torch.device("meta"), torch.no_grad():
        model = build_model(config.model, vocab).to(torch.bfloat16)
        ids = torch.zeros(2, config.model.context, dtype=torch.long)
        logits = model(ids)
    assert logits.shape == (2, config.model.context, vocab)


def test_the_plan_fits_six_minutes_by_its_own_arithmetic():
    plan = plan_of(get_preset("gpu-study"))
    budget = plan.budget
    assert budget is GPU_STUDY_BUDGET and budget.limit_s == LIMIT_S
    assert len(plan.runs) == 4
    # the arithmetic, recomputed here from the preset
    config = plan.config
    tokens = config.run.steps * config.data.batch_size * config.model.context
    assert plan.tokens_per_run == tokens
    assert plan.flops_per_token == 6 * plan.params + 12 * 14 * 768 * 512
    sustained = budget.peak_flops * budget.mfu
    assert plan.train_s() == pytest.approx(tokens * plan.flops_per_token / sustained)
    evals = 1 + config.run.steps // config.run.eval_every  # before, every 250, the last
    assert plan.evaluations == evals
    assert plan.eval_s() == pytest.approx(
        evals * config.run.eval_batches * config.data.batch_size * config.model.context
        * plan.flops_per_token / 3 / sustained)
    per_run = plan.train_s() + plan.eval_s() + budget.per_run_s
    assert plan.total_s() == pytest.approx(budget.setup_s + 4 * per_run)
    assert plan.fits() and plan.total_s() <= LIMIT_S


def test_a_longer_plan_does_not_fit():
    config = get_preset("gpu-study").replace(run={"steps": 10_000})
    plan = plan_of(config)
    assert not plan.fits()
    assert "DOES NOT FIT" in format_plan(plan)


def test_flops_per_token_is_six_n_plus_attention():
    m = get_preset("gpu-study").model
    assert flops_per_token(m, 1000) == 6000 + 12 * m.n_layers * m.d_model * m.context


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["compare", "--preset", "gpu-study", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    assert "4 runs on cuda: bf16, mixed, light, plus" in text
    assert "112,207,872 parameters" in text
    assert "8,192,000 tokens per run" in text
    total = re.search(r"total: .* = (\d+) s; limit (\d+) s: fits", text)
    assert total and int(total.group(1)) <= int(total.group(2)) == LIMIT_S


def test_dry_run_follows_the_flags(capsys):
    assert main(["compare", "--preset", "gpu-study", "--dry-run", "--steps", "10000"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_dry_run_of_a_preset_without_budget_gives_no_time(capsys):
    assert main(["compare", "--preset", "quick", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "no estimate" in text and "fits" not in text


def test_without_a_gpu_the_comparison_stops_at_once_naming_the_flag(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there")
    assert main(["compare", "--preset", "gpu-study", "--out", str(tmp_path / "x")]) == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


#: gpu-study shrunk to seconds on CPU: the same preset and harness (corpus, BPE, every
#: strategy, report), a micro model on 200 kB of the standard library.
SHRINK = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--context", "32",
          "--batch-size", "4", "--max-bytes", "200000", "--vocab-size", "512", "--steps", "4",
          "--warmup-steps", "1", "--eval-every", "2", "--eval-batches", "2", "--track-every",
          "2", "--device", "cpu", "--no-isolate", "--quiet",
          # the foreach kernels: the native C kernels would first be compiled into the
          # test's fresh cache (a minute on 2 cores); a GPU steps with Triton anyway
          "--foreach", "true"]


def test_the_same_code_path_trains_on_cpu_at_a_micro_size(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "study"
    assert main(["compare", "--preset", "gpu-study", *SHRINK, "--out", str(out)]) == 0
    with open(out / "results.json") as handle:
        records = json.load(handle)
    assert [r["strategy"] for r in records] == list(GPU_STUDY_STRATEGIES)
    for record in records:
        assert record["beta2"] == 0.999
        assert record["tokens_per_s"] > 0 and record["peak_memory_bytes"] > 0
    history = json.loads((out / "history.json").read_text())
    assert all(history[s]["edq"] for s in GPU_STUDY_STRATEGIES)  # EDQ was measured
    report = (out / "report.md").read_text()
    assert "byte-level BPE" in report and "standard library" in report


# --- benchmarks/gpu_study.sh -------------------------------------------------------------

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, check=False, env=environment)


def test_the_script_is_executable():
    assert os.access(SCRIPT, os.X_OK)


@needs_bash
@pytest.mark.parametrize("args,message", [((), "OUT is required"),
                                          (("--bogus", "out"), "unknown option --bogus"),
                                          (("a", "b"), "one OUT folder")])
def test_the_script_refuses_bad_arguments(args, message):
    done = _script(*args)
    assert done.returncode == 2 and message in done.stderr


@needs_bash
def test_the_script_s_dry_run_prints_the_plan_and_its_stages_fit(tmp_path):
    out = tmp_path / "results"
    done = _script("--dry-run", str(out))
    assert done.returncode == 0, done.stderr
    assert not out.exists()
    assert "112,207,872 parameters" in done.stdout and ": fits" in done.stdout
    stages = re.findall(r"^\[(\w+)\] timeout (\d+)s: (.*)$", done.stdout, re.M)
    assert [s[0] for s in stages] == ["study", "report", "pack"]
    assert sum(int(s[1]) for s in stages) <= LIMIT_S  # the caps alone keep 6 minutes
    study = stages[0][2]
    assert "compare --preset gpu-study" in study and f"--out {out}" in study
    assert "--report-only" in stages[1][2]
