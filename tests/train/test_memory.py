"""The bytes-per-parameter model, checked against tensors measured in a real run."""

from __future__ import annotations

import pytest
import torch

import collage
from collage.train.config import ModelConfig
from collage.train.data import VOCAB_SIZE
from collage.train.memory import bytes_per_param, memory_table, persistent_bytes
from collage.train.models import build_model
from collage.train.runner import param_groups, weight_dtype


@pytest.mark.parametrize(
    "strategy, total, parts",
    [
        ("bf16", 8, (2, 2, 4, 0)),
        ("stochastic", 8, (2, 2, 4, 0)),
        ("kahan", 10, (2, 2, 4, 2)),
        ("light", 10, (2, 2, 4, 2)),
        ("plus", 12, (2, 2, 4, 4)),
        ("split", 12, (2, 2, 4, 4)),
        ("mixed", 16, (6, 2, 8, 0)),
        ("fp32", 16, (4, 4, 8, 0)),
    ],
)
def test_formula(strategy, total, parts):
    b = bytes_per_param(strategy)  # gradients in bf16 by default
    assert b.total == total
    assert (b.weights, b.gradients, b.optimizer_states, b.compensation) == parts


def test_fp32_gradients_cost_two_more_bytes_except_for_fp32():
    for name in collage.STRATEGIES:
        extra = 0 if name == "fp32" else 2
        assert bytes_per_param(name, "fp32").total == bytes_per_param(name).total + extra
    with pytest.raises(ValueError, match="grad_dtype"):
        bytes_per_param("plus", "fp16")
    with pytest.raises(ValueError, match="valid strategies"):
        bytes_per_param("nope")


def test_every_strategy_is_modelled():
    for name in collage.STRATEGIES:
        assert bytes_per_param(name).total > 0


def test_table_totals():
    table = memory_table(6.7e9, ["mixed", "bf16", "plus"])
    assert "107.20" in table and "53.60" in table and "80.40" in table  # 16, 8, 12 B x 6.7e9
    assert "-53.60 GB (-50%)" in table and "-26.80 GB (-25%)" in table


@pytest.mark.parametrize("strategy", collage.STRATEGIES)
def test_formula_matches_measured_tensors(strategy):
    """After one real step, the exact persistent bytes per parameter are the formula's.

    The only difference is the optimizer's per-tensor ``step`` counter (4 bytes per
    parameter *tensor*, not per element): about 0.002 B/param here, 0 for large models.
    Embeddings, norms and biases are all included.
    """
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, context=32)
    model = build_model(cfg, VOCAB_SIZE, seed=0).to(weight_dtype(strategy))
    opt = collage.AdamW(param_groups(model, 0.1), lr=1e-3, strategy=strategy)
    model(torch.randint(0, 256, (2, 32))).float().logsumexp(-1).mean().backward()
    opt.step()
    measured = persistent_bytes(model, opt)
    n = measured["n_params"]
    model_b = bytes_per_param(strategy)
    assert measured["model_total"] / n == pytest.approx(model_b.total, rel=0.01)
    n_tensors = len(list(model.parameters()))
    assert measured["model_total"] - model_b.total * n == 4 * n_tensors  # the step counters
    assert (measured["weights"] + measured["master"]) == model_b.weights * n
    assert measured["gradients"] == model_b.gradients * n
    assert measured["compensation"] == model_b.compensation * n


def test_persistent_bytes_deduplicates_tied_weights():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, context=32, tie_weights=True)
    model = build_model(cfg, VOCAB_SIZE, seed=0)
    measured = persistent_bytes(model)
    assert measured["weights"] == 4 * sum(p.numel() for p in model.parameters())
    assert measured["gradients"] == 0 and measured["total"] == measured["weights"]
