"""Issue #3, criterion 3: Collage-plus's second moment under a constant gradient.

With grad = g at every step, AdamW's second moment is exactly ``v_t = (1 - beta2**t) g**2``.
bf16(0.999) == 1.0, so a bf16 EMA with beta2 = 0.999 cannot decay, and its increments
``(1 - beta2) g**2`` fall below half an ulp of v long before v reaches g**2: v stalls.
``plus`` keeps v as a pair (exp_avg_sq, exp_avg_sq_lo) and multiplies by beta2 split into
two bf16 components; ``v = hi + lo`` is exact in float64.

Tolerance: the issue's 1%, checked at every t in 1..3000. What it has to absorb, all fixed
by the data (deterministic): the reference path rounds the increment (1 - beta2) g**2 three
times in bf16 (fl(g*g), fl(1 - beta2), their product) and the float32 path once into the
pair; the pair's product and grow err by ~8 u**2 = 1.2e-4 of v per step (u = 2**-8), a bound
that would allow ~10% drift at beta2 = 0.999 if every rounding went the same way. Measured:
<= 0.41% on the reference path, <= 0.03% on the float32 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import collage
from collage import mcf

from ._common import BF16, PATHS

STEPS = 3000
TRACK_TOL = 0.01
STALL_MIN = 0.10
G = (1.0, 0.01)  # two elements of one parameter; the target uses their bf16 values


@dataclass(frozen=True)
class MomentCase:
    strategy: str
    beta2: float
    path: str
    tracks: bool  # True: within 1% at every t; False: > 10% off at t = 3000

    def __str__(self) -> str:
        return f"{self.strategy}-{self.beta2}-{self.path}"


def _cases():
    # The reference path costs ~2.5 ms of Python per step (every op rounded in float64):
    # 3000 steps take 8-20 s, so only beta2 = 0.999 (the case bf16 cannot represent) runs by
    # default there; 0.95 and 0.99 on the reference path are marked slow.
    for beta2 in (0.95, 0.99, 0.999):
        yield MomentCase("plus", beta2, "foreach", True)
        ref = MomentCase("plus", beta2, "reference", True)
        yield ref if beta2 == 0.999 else pytest.param(ref, marks=pytest.mark.slow, id=str(ref))
    for strategy in ("light", "bf16"):
        for path in ("foreach", "reference"):
            yield MomentCase(strategy, 0.999, path, False)


def _second_moment_errors(case: MomentCase):
    """Relative error of v against (1 - beta2**t) g**2: worst over t, and at t = STEPS."""
    g = torch.tensor(G, dtype=BF16)
    param = torch.nn.Parameter(torch.zeros(len(G), dtype=BF16))
    opt = collage.AdamW([param], lr=1e-3, betas=(0.9, case.beta2), weight_decay=0.0,
                        strategy=case.strategy, **PATHS[case.path])
    g2 = g.double() ** 2
    worst = torch.zeros(len(G), dtype=torch.float64)
    for t in range(1, STEPS + 1):
        param.grad = g.clone()
        opt.step()
        state = opt.state[param]
        v = state["exp_avg_sq"].double()
        if "exp_avg_sq_lo" in state:
            v = v + state["exp_avg_sq_lo"].double()  # exact: two bf16 components
        target = (1.0 - case.beta2**t) * g2
        relative = ((v - target) / target).abs()
        worst = torch.maximum(worst, relative)
    return worst, relative


@pytest.mark.parametrize("case", list(_cases()), ids=str)
def test_second_moment_under_constant_gradient(case: MomentCase) -> None:
    worst, final = _second_moment_errors(case)
    print(f"{case}: worst relative error over t {worst.tolist()}, at t={STEPS} {final.tolist()}"
          f" for g={G}")
    if case.tracks:
        assert float(worst.max()) <= TRACK_TOL
    else:
        assert float(final.min()) > STALL_MIN, "expected the bf16 second moment to stall"


# ------------------------------------------------------------------------------------------
# The research code's defective MCF multiply
# ------------------------------------------------------------------------------------------


def _fl(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded to bf16 (x is an exact float64 result of bf16 operands)."""
    return mcf.round_to(x, BF16)


def research_mul(hi, lo, b_hi, b_lo):
    """The research code's expansion product, defect included.

    It multiplies ``hi`` in place (``hi.mul_(b_hi)``) and only *then* computes two_prod's
    error term, from the overwritten ``hi``: ``err = hi_new * b_hi - fl(hi_new * b_hi)``,
    the rounding error of the *next* product instead of ``hi * b_hi - hi_new``. The rest
    is DWTimesDW1 as in collage.mcf.mul.
    """
    hi = mcf.two_prod(hi, b_hi)[0]  # the in-place product: the input hi is gone
    _, err = mcf.two_prod(hi, b_hi)  # the defect: error of the overwritten hi
    hi_b_lo = _fl(hi.double() * b_lo.double())
    lo_b_hi = _fl(lo.double() * b_hi.double())
    cross = _fl(hi_b_lo.double() + lo_b_hi.double())
    return mcf.fast_two_sum(hi, _fl(err.double() + cross.double()))


def _nearest_split(beta: float):
    """beta as bf16 pair, high part rounded to nearest (what collage does)."""
    b = torch.tensor(beta, dtype=torch.float64)
    hi = _fl(b)
    return hi, _fl(b - hi.double())


def _truncating_split(beta: float):
    """beta as bf16 pair, high part the top 16 bits of float32 beta (a bit-mask split)."""
    b32 = torch.tensor(beta, dtype=torch.float32)
    hi = (b32.view(torch.int32) & -65536).view(torch.float32).to(BF16)  # exact: truncated
    return hi, _fl(torch.tensor(beta, dtype=torch.float64) - hi.double())


#: (label, split, beta2): one element per (config, g) in a single vectorised run
SPLITS = (("nearest", _nearest_split, 0.95), ("nearest", _nearest_split, 0.99),
          ("nearest", _nearest_split, 0.999), ("truncating", _truncating_split, 0.999))


def test_research_mul_defect_makes_the_second_moment_drift() -> None:
    """v <- beta2 * v + (1 - beta2) g**2 as an MCF, with collage.mcf.mul and with the
    research code's multiply, from the same increment; the target is (1 - b**t) g**2 with b
    the beta2 the pair applies (b_hi + b_lo, within 2.1e-6 of beta2 for the nearest split).

    The defect changes nothing when b_hi == 1: two_prod(x, 1) has no error, whichever x. With
    round-to-nearest bf16(0.999) == 1.0, so at beta2 = 0.999 the defective multiply is
    bitwise the correct one; it drifts at 0.95 and 0.99 (b_hi = 0.949, 0.988), and at 0.999
    as soon as beta2's high part is not 1 (truncating split: b_hi = 0.99609375).
    """
    labels, b_hi, b_lo, g = [], [], [], []
    for label, split, beta2 in SPLITS:
        hi, lo = split(beta2)
        for gv in G:
            labels.append(f"{label} beta2={beta2} g={gv}")
            b_hi.append(hi)
            b_lo.append(lo)
            g.append(gv)
    b_hi, b_lo = torch.stack(b_hi), torch.stack(b_lo)
    g = torch.tensor(g, dtype=BF16)
    b = b_hi.double() + b_lo.double()
    increment = _fl(_fl(1.0 - b).double() * _fl(g.double() ** 2).double())
    target_scale = g.double() ** 2
    results = {}
    for name, multiply in (("collage", mcf.mul), ("research", research_mul)):
        hi, lo = torch.zeros_like(g), torch.zeros_like(g)
        worst = torch.zeros(len(g), dtype=torch.float64)
        for t in range(1, STEPS + 1):
            hi, lo = multiply(hi, lo, b_hi, b_lo)
            hi, lo = mcf.grow(hi, lo, increment)
            relative = (hi.double() + lo.double()) / ((1.0 - b**t) * target_scale) - 1.0
            worst = torch.maximum(worst, relative.abs())
        results[name] = (worst, relative, hi, lo)
    for i, label in enumerate(labels):
        ok, bad = results["collage"], results["research"]
        print(f"{label}: collage.mcf.mul worst {float(ok[0][i]):.4%} final "
              f"{float(ok[1][i]):+.4%} | research worst {float(bad[0][i]):.4%} final "
              f"{float(bad[1][i]):+.4%}")
    correct_worst, research_worst = results["collage"][0], results["research"][0]
    assert float(correct_worst.max()) <= TRACK_TOL  # the correct multiply tracks everywhere
    for i, label in enumerate(labels):
        if "nearest beta2=0.999" in label:
            for k in (2, 3):  # hi, lo bit for bit
                assert torch.equal(results["collage"][k][i], results["research"][k][i]), label
        else:
            assert float(research_worst[i]) > TRACK_TOL, label
        if label.startswith("truncating"):
            assert abs(float(results["research"][1][i])) > STALL_MIN, label
