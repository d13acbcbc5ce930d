"""The float32 building blocks of the CPU measured step: ``component_change`` (exact zero
test) and ``update_sums_blocked`` (row sums in float32) against float64 and ``fsum``."""

from __future__ import annotations

import math

import pytest
import torch

from collage.metrics import component_change, update_sums_blocked
from collage.metrics.stats import BLOCK, FIELDS

from ._reference import Update, reference_metrics

BF16 = torch.bfloat16
U = 2.0**-24  # float32 rounding unit


def _pairs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """bf16 (hi, lo) before and after with adversarial changes: unchanged values held by
    different components (hi up one ulp, lo down one ulp), lo jumping across more than
    2**15 (inexact float32 differences), hi jumping by 2**20, and plain small steps."""
    g = torch.Generator().manual_seed(seed)
    hi = torch.randn(n, generator=g).to(BF16)
    ulp = (hi.float().abs() * 2.0**-7).to(BF16).float()  # about one bf16 ulp of hi
    lo = (ulp * (torch.rand(n, generator=g) - 0.5)
          * torch.exp2(-40 * torch.rand(n, generator=g))).to(BF16)
    kind = torch.randint(0, 4, (n,), generator=g)
    hi2, lo2 = hi.clone(), lo.clone()
    moved = hi.float() + ulp
    same = (moved.to(BF16).float() - hi.float()) == ulp  # hi + ulp is representable
    renorm = (kind == 0) & same
    hi2[renorm] = moved[renorm].to(BF16)
    lo2[renorm] = (lo.float() - ulp)[renorm].to(BF16)
    jump_lo = kind == 1
    lo2[jump_lo] = (ulp * 0.25)[jump_lo].to(BF16)
    jump_hi = kind == 2
    hi2[jump_hi] = (hi.float() * 2.0**20)[jump_hi].to(BF16)
    step = kind == 3
    lo2[step] = (lo.float() + ulp * 1e-3 * torch.randn(n, generator=g))[step].to(BF16)
    return hi, lo, hi2, lo2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("seed", range(2))
def test_component_change_zero_test_is_exact_for_pairs(seed, compiled):
    # compiled: TwoSum must survive inductor and the C++ compiler (no reassociation)
    change = torch.compile(component_change, dynamic=True) if compiled else component_change
    hi, lo, hi2, lo2 = _pairs(4096, seed)
    # float64 holds every bf16 pair sum here exactly (at most ~60 bits apart: see _pairs)
    a = hi.double() + lo.double()
    b = hi2.double() + lo2.double()
    exact = (hi2.double() - hi.double()) + (lo2.double() - lo.double())
    e, stuck = change([hi.float(), lo.float()], [hi2.float(), lo2.float()])
    assert torch.equal(stuck, exact == 0)
    assert torch.equal(stuck, b == a)
    assert 0 < int(stuck.sum()) < stuck.numel()  # renormalised pairs are counted as stuck
    # e = fl(fl(sh + sl) + fl(th + tl)): at most about 2u|e| plus u^2 of the parts
    parts = (hi2.double() - hi.double()).abs() + (lo2.double() - lo.double()).abs()
    assert bool(((e.double() - exact).abs() <= 2 * U * exact.abs() + 4 * U * U * parts).all())


def test_component_change_single_component():
    before = torch.tensor([1.0, 1.0, 0.0, -0.0, float("inf"), 3.0, 2.0**-149])
    after = torch.tensor([1.0, 1.0 + 2**-23, -0.0, 0.0, float("inf"), 3.0 * 2**30, 0.0])
    e, stuck = component_change([before], [after])
    assert stuck.tolist() == [True, False, True, True, False, False, False]
    assert e[1] == 2**-23 and e[6] == -(2.0**-149)


def _reference_and_blocked(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (rows, cols)
    d = torch.randn(shape, generator=g) * torch.exp2(-10 * torch.rand(shape, generator=g))
    d[torch.rand(shape, generator=g) < 0.2] = 0.0
    e = d * (torch.rand(shape, generator=g) < 0.7)  # some arrive, some are lost
    ev = (e * 1.001).to(BF16).float()
    c = torch.randn(shape, generator=g).to(BF16)
    got = update_sums_blocked(d, e, e == 0, ev, ev == 0, c)
    zero = torch.zeros(rows * cols, dtype=torch.float64)
    ref = reference_metrics([Update(d, zero, e, visible_before=zero, visible_after=ev,
                                    compensation=c)])
    return got, ref, (d.double(), e.double(), ev.double(), c.double())


@pytest.mark.parametrize("rows,cols", [(40, BLOCK), (1, 77), (3, BLOCK)])
def test_update_sums_blocked_within_the_stated_bound(rows, cols):
    got, ref, (d, e, ev, c) = _reference_and_blocked(rows, cols, rows + cols)
    s = dict(zip(FIELDS, got.tolist()))
    assert s["n_elements"] == s["n_compensation"] == rows * cols
    assert s["n_stuck"] / s["n_nonzero"] == ref["imprecision"]  # counts exact
    assert s["n_stuck_visible"] / s["n_nonzero"] == ref["imprecision_visible"]
    # Each sum within (cols + 1) u of the sum of |terms| (one rounding per product, at
    # most cols - 1 in the row, one for the float64 row total), to first order.
    bound = (cols + 2) * U
    for name, x, y in (("dot_ed", e, d), ("dd", d, d), ("ee", e, e), ("dot_evd", ev, d),
                       ("evev", ev, ev), ("cc", c, c)):
        exact = math.fsum((x * y).reshape(-1).tolist())
        magnitude = math.fsum((x * y).abs().reshape(-1).tolist())
        assert abs(s[name] - exact) <= bound * magnitude, name
    assert math.isclose(s["dot_ed"] / s["dd"], ref["edq"], rel_tol=4 * bound)
