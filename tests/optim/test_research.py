"""``reference=True`` is the research algorithm as it runs (issue #24): PyTorch operations on
bf16 tensors, each computing in float32 and rounding once to bf16, in the published code's
order and AdamW form (``step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``, ``denom =
sqrt(v) + eps``, "compact" weight decay ``- lr * wd * w`` inside the update) and its
``Grow`` landing.

The expected values are computed here in float64 and rounded as torch's CPU kernels round a
bf16 operation (torch 2.x): the exact result to float32, then to bf16; a scalar factor
(``mul``, ``addcmul``'s ``value``) to float32 first, but an ``add``'s ``alpha`` and an added
scalar to bf16 first (``exp_avg.add_(grad, alpha=1 - beta1)`` multiplies by bf16(0.1), and
``denom.add_(eps)`` adds bf16(eps)). Independent of torch's kernels and of collage. The cases are picked where a model that rounds every elementary
operation to bf16 (the reference path before issue #24) gives another answer, so the test
fails for that model. Gradients are powers of two, so that every product with a float32
constant is exact in float32 and a fused multiply-add and a separate one agree; square
roots and quotients are checked to stay clear of bf16 rounding ties.
"""

from __future__ import annotations

import math

import pytest
import torch

import collage
from collage import mcf

BF16 = torch.bfloat16


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return mcf.round_to(x.double(), dtype).double()


def torch_op(exact: torch.Tensor) -> torch.Tensor:
    """A bf16 PyTorch operation: the exact result rounded to float32, then to bf16."""
    return _to(_to(exact, torch.float32), BF16)


def per_op(exact: torch.Tensor) -> torch.Tensor:
    """An operation of the per-elementary-op model: the exact result rounded once to bf16."""
    return _to(exact, BF16)


def research_light_step(p, lo, m, v, g, lr, beta1, beta2, eps, wd, step, op, factor, added):
    """One step of the research code's AdamW with Collage-light on float64 tensors holding
    bf16 values; ``op`` rounds an operation's exact result, ``factor`` a scalar factor,
    ``added`` an ``add``'s alpha or added scalar. Returns (p, lo, m, v) after the step."""
    m = op(m * factor(beta1))  # exp_avg.mul_(beta1)
    m = op(m + added(1.0 - beta1) * g)  # .add_(grad, alpha=1 - beta1)
    v = op(v * factor(beta2))  # exp_avg_sq.mul_(beta2)
    v = op(v + factor(1.0 - beta2) * g * g)  # .addcmul_(grad, grad, value=1 - beta2)
    denom = op(op(v.sqrt()) + added(eps))  # exp_avg_sq.sqrt().add_(eps)
    step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    raw = op(op(m * factor(-step_size)) / denom)  # -step_size * exp_avg / denom
    if wd > 0:
        raw = op(raw - op(p * factor(lr * wd)))  # ... - lr * wd * p
    total = op(p + raw)  # Grow_Exp_: sum, correction into lo, renormalisation
    lo = op(lo + op(raw - op(total - p)))
    hi = op(total + lo)
    lo = op(lo - op(hi - total))
    return hi, lo, m, v


def _float32(x: float) -> torch.Tensor:
    return _to(torch.tensor(x, dtype=torch.float64), torch.float32)


def _bf16(x: float) -> torch.Tensor:
    return _to(torch.tensor(x, dtype=torch.float64), BF16)


# (p, lo, m, v, g) as bf16 values, (lr, beta1, beta2, eps, wd), the step: found by a random
# search for cases where the per-elementary-op model differs (in the weight, its low part,
# m or v), and kept clear of rounding ties (test_cases_stay_clear_of_ties)
CASES = [
    ((0.05126953125, -7.915496826171875e-05, -0.451171875, 0.1376953125, -1.0),
     (0.01, 0.85, 0.95, 1e-08, 0.1), 4),
    ((-0.012939453125, -1.6927719116210938e-05, -0.09375, 0.006866455078125, 0.125),
     (0.01, 0.9, 0.999, 1e-06, 0.1), 10),
    ((-0.0008392333984375, -6.705522537231445e-07, -0.1337890625, 0.09228515625, 0.25),
     (0.001, 0.85, 0.99, 1e-08, 0.1), 11),
    ((-0.08837890625, 8.20159912109375e-05, -0.65625, 0.88671875, -1.0),
     (0.01, 0.85, 0.95, 1e-08, 0.1), 10),
    ((2.296875, 0.0, -0.003814697265625, 0.00103759765625, 0.03125),
     (0.001, 0.85, 0.99, 1e-08, 0.0), 9),
    ((-1.390625, 0.0, -0.2099609375, 0.1044921875, -0.5), (0.0003, 0.9, 0.95, 1e-08, 0.1), 9),
]


def _state(case):
    values, hyper, step = case
    return [torch.tensor([x], dtype=torch.float64) for x in values], hyper, step


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"step{c[2]}")
def test_reference_rounds_as_torch_operations(case):
    (p, lo, m, v, g), (lr, beta1, beta2, eps, wd), step = _state(case)
    want = research_light_step(p, lo, m, v, g, lr, beta1, beta2, eps, wd, step, torch_op,
                               _float32, _bf16)
    # the case discriminates: rounding every elementary operation to bf16 (constants too)
    # gives another result
    other = research_light_step(p, lo, m, v, g, lr, beta1, beta2, eps, wd, step, per_op,
                                _bf16, _bf16)
    assert any(not torch.equal(a, b) for a, b in zip(want, other))
    param = torch.nn.Parameter(p.to(BF16))
    opt = collage.AdamW([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                        strategy="light", reference=True)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.to(BF16),
                        "exp_avg_sq": v.to(BF16), "weight_lo": lo.to(BF16)}
    param.grad = g.to(BF16)
    opt.step()
    state = opt.state[param]
    got = (param.detach(), state["weight_lo"], state["exp_avg"], state["exp_avg_sq"])
    for name, a, b in zip(("w", "lo", "m", "v"), got, want):
        assert a.double().item() == b.item(), name


def test_cases_stay_clear_of_ties():
    """The float32 square root and quotient of each case are not within two float32 units
    of a bf16 rounding boundary, where a torch kernel whose float32 sqrt is one unit off
    (not correctly rounded) could round the other way."""
    for case in CASES:
        (p, lo, m, v, g), (lr, beta1, beta2, eps, wd), step = _state(case)
        m1 = torch_op(torch_op(m * _float32(beta1)) + _bf16(1.0 - beta1) * g)
        v1 = torch_op(torch_op(v * _float32(beta2)) + _float32(1.0 - beta2) * g * g)
        root = _to(v1.sqrt(), torch.float32)
        for x in (root,):
            bf = _to(x, BF16)
            spacing = mcf.ulp(bf.to(BF16)).double()
            boundary = bf + torch.sign(x - bf) * spacing / 2
            assert ((x - boundary).abs() > 2 * mcf.ulp(x.float()).double()).all()
        assert torch.isfinite(m1).all()
