"""The ``feedback`` strategy (ECO, arXiv 2601.22101): bf16 weights and states, each update's
rounding error fed back into the momentum, no extra memory (issue #22)."""

from __future__ import annotations

import math

import pytest
import torch

import collage
from collage.optim import compiled, get_strategy
from collage.optim.rules import ADAMW, SGD
from collage.train.memory import bytes_per_param

from ._common import make_mlp, train_step

BF16 = torch.bfloat16
PATHS = {"reference": {"reference": True}, "per_tensor": {"foreach": False},
         "foreach": {"foreach": True}, "default": {}}
if compiled.available():
    PATHS["compiled"] = {"fused": True}


def _moved(strategy: str, flags: dict, make) -> float:
    """How far 1,000 steps under a constant gradient move bf16 weights of 1.0."""
    w = torch.nn.Parameter(torch.ones(64, dtype=BF16))
    opt = make([w], strategy, flags)
    for _ in range(1000):
        w.grad = torch.ones_like(w)
        opt.step()
    return 1.0 - float(w.float().mean())


def _adamw(params, strategy, flags):
    return collage.AdamW(params, lr=1e-4, weight_decay=0.0, strategy=strategy, **flags)


def _sgd(params, strategy, flags):
    # a constant gradient 1 builds a buffer of 1 / (1 - 0.9) = 10: 1e-4 per step
    return collage.SGD(params, lr=1e-5, momentum=0.9, strategy=strategy, **flags)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make", [_adamw, _sgd], ids=["adamw", "sgd"])
def test_tiny_updates_are_not_lost_on_average(make, path):
    """1,000 steps of 1e-4 on a weight of 1.0 (half a bf16 spacing there is 2**-9, about 20
    such steps): plain bf16 does not move at all; with the error fed back the weight moves
    by about the 0.1 intended (within the feedback's approximations: the next steps'
    step size and denominator are taken at this step's, and the momentum holds the fed-back
    error in bf16)."""
    assert _moved("bf16", PATHS[path], make) == 0.0
    moved = _moved("feedback", PATHS[path], make)
    assert 0.06 < moved < 0.15, moved


def test_one_step_feeds_the_rounding_error_into_the_momentum():
    """From a hand-made state, one AdamW step: the stored weight is the update rounded to
    nearest, and m is the plain EMA minus error * (1 - beta1) * D / (step_size' * beta1),
    computed here in float64 from the definitions and rounded once to bf16."""
    lr, b1, b2, eps, step = 1e-3, 0.9, 0.999, 1e-8, 5
    w0, m0, v0, g = 0.75, 0.125, 0.015625, 0.25  # bf16 values
    param = torch.nn.Parameter(torch.tensor([w0], dtype=BF16))
    opt = collage.AdamW([param], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0,
                        strategy="feedback", foreach=True)
    opt.state[param] = {"step": torch.tensor(float(step - 1)),
                        "exp_avg": torch.tensor([m0], dtype=BF16),
                        "exp_avg_sq": torch.tensor([v0], dtype=BF16)}
    param.grad = torch.tensor([g], dtype=BF16)
    opt.step()
    m = b1 * m0 + (1 - b1) * g
    v = b2 * v0 + (1 - b2) * g * g
    v_stored = float(torch.tensor(v).to(BF16))
    update = -lr / (1 - b1**step) * m / (math.sqrt(v / (1 - b2**step)) + eps)
    new = w0 + update
    stored = float(torch.tensor(new).to(BF16))
    error = new - stored
    denom = math.sqrt(v_stored / (1 - b2 ** (step + 1))) + eps
    m_fed = m - error * (1 - b1) * denom / (lr / (1 - b1 ** (step + 1)) * b1)
    assert float(param) == stored
    assert error != 0  # the case feeds something back
    got = float(opt.state[param]["exp_avg"])
    assert abs(got - m_fed) <= abs(m_fed) * 2.0**-8, (got, m_fed)


def test_it_costs_what_bf16_costs():
    assert bytes_per_param("feedback").total == bytes_per_param("bf16").total == 8
    keys = {c.key for c in get_strategy("feedback").components(ADAMW)}
    assert keys == {c.key for c in get_strategy("bf16").components(ADAMW)}


def test_lr_zero_feeds_nothing_back():
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="feedback")
    for step in range(3):
        train_step(model, opt, step)
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3, 5):
        train_step(model, opt, step)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(s["exp_avg"]).all() for s in opt.state.values())


def test_it_needs_a_momentum():
    p = [torch.nn.Parameter(torch.zeros(3, dtype=BF16))]
    with pytest.raises(ValueError, match="Lion"):
        collage.Lion(p, strategy="feedback")
    with pytest.raises(ValueError, match="momentum > 0"):
        collage.SGD(p, momentum=0.0, strategy="feedback")
    with pytest.raises(ValueError, match=r"betas\[0\] > 0"):
        collage.AdamW(p, betas=(0.0, 0.999), strategy="feedback")
    assert SGD.feeds_back and ADAMW.feeds_back


def test_it_trains_like_mixed_precision():
    final = {}
    for strategy in ("feedback", "mixed"):
        model = make_mlp()
        opt = collage.AdamW(model.parameters(), lr=1e-2, strategy=strategy)
        losses = [train_step(model, opt, step % 4) for step in range(40)]
        final[strategy] = sum(losses[-4:]) / 4
        assert final[strategy] < 0.8 * losses[0]
    assert abs(final["feedback"] - final["mixed"]) < 0.01 * final["mixed"]
