"""The study preset (docs/study.md) and its whole pipeline on a micro model: seeds x
learning rates x beta2 records, the report's sections, the Pareto plot, resumption."""

from __future__ import annotations

import json
import os

import pytest

from collage.cli import main
from collage.train import config as config_module
from collage.train.config import strategies
from collage.train.presets import STUDY_STRATEGIES, get_preset
from collage.train.runs import RESULT_NAME

#: The study preset shrunk to seconds: a micro model on 200 kB of the standard library.
MICRO = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--context", "32",
         "--batch-size", "4", "--max-bytes", "200000", "--vocab-size", "512", "--steps", "4",
         "--warmup-steps", "1", "--eval-every", "2", "--eval-batches", "2", "--track-every",
         "2", "--seeds", "2", "--no-isolate", "--quiet"]


def test_study_preset_is_the_planned_study():
    study = get_preset("study")
    assert (study.model.family, study.data.path, study.data.tokenizer) == (
        "llama", "stdlib", "bpe")
    assert study.run.beta2s == (0.95, 0.999) and study.run.seeds >= 3
    assert study.run.lrs_strategies == ("stochastic",) and study.optim.lr in study.run.lrs
    assert study.run.resume and study.run.checkpoint_every > 0
    # every study strategy this build registers, in the study's order
    assert study.run.strategies == tuple(s for s in STUDY_STRATEGIES if s in strategies())
    assert {"fp32", "mixed", "bf16", "stochastic", "kahan", "light", "plus", "split",
            "plus8"} <= set(study.run.strategies)


def test_a_strategy_registered_later_joins_the_study(monkeypatch):
    """Strategy names are data: once collage registers 'feedback', the preset runs it."""
    monkeypatch.setattr(config_module, "STRATEGIES",
                        tuple(s for s in config_module.STRATEGIES if s != "feedback"))
    assert "feedback" not in get_preset("study").run.strategies
    monkeypatch.setattr(config_module, "STRATEGIES", config_module.STRATEGIES + ("feedback",))
    names = get_preset("study").run.strategies
    assert names.index("split") < names.index("feedback") < names.index("plus8")


def test_the_study_pipeline_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "study"
    argv = ["compare", "--preset", "study", *MICRO, "--strategies", "fp32", "mixed",
            "stochastic", "--out", str(out)]
    assert main(argv) == 0
    with open(out / "results.json") as handle:
        records = json.load(handle)
    # beta2 (2) x [fp32 and mixed at lr 2e-3, stochastic at 1e-3, 2e-3, 4e-3], 2 seeds each
    assert len(records) == 2 * 5 and all(r["seeds"] == [0, 1] for r in records)
    assert {(r["strategy"], r["lr"]) for r in records} == {
        ("fp32", 2e-3), ("mixed", 2e-3), ("stochastic", 1e-3), ("stochastic", 2e-3),
        ("stochastic", 4e-3)}
    assert sum(r["best_lr"] for r in records) == 2 * 3  # one per strategy and beta2
    results = sorted(p.name for p in (out / "runs").iterdir())
    assert len(results) == 20 and all((out / "runs" / n / RESULT_NAME).exists()
                                      for n in results)
    report = (out / "report.md").read_text()
    for section in ("## Results over seeds", "## Best learning rate",
                    "## Memory against loss (Pareto front)", "byte-level BPE tokens",
                    "standard library"):
        assert section in report, section
    assert (out / "pareto.png").stat().st_size > 0
    # the same command again: every run finished, nothing trains, the same records
    os.remove(out / "results.json")
    assert main(argv) == 0
    with open(out / "results.json") as handle:
        assert json.load(handle) == records
