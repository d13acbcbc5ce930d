"""The CPU measured compiled step (``compiled.py``: float32 per element, row sums in
float32, rows in float64) against the float64 measured kernel on the same steps. The native
kernels are switched off here (they measure covered groups first; their measured step has
its own tests in test_native_measured.py).

Both kernels perform the same compiled step, so the weights must agree bit for bit and the
counts exactly; the sums may differ by the bound ``update_sums_blocked`` states.
"""

from __future__ import annotations

import math

import pytest
import torch

import collage
from collage.metrics.stats import BLOCK
from collage.optim import compiled, native

STRATEGIES = ("fp32", "bf16", "stochastic", "mixed", "split", "kahan", "light", "plus")
#: strategies whose two measured kernels take inductor 60-120 s each to compile on a cold
#: cache (2 cores): run with ``-m slow``. ``split`` (a weight in two parts, a float32
#: master's low bits) keeps a compensated weight in the default run.
SLOW_TO_COMPILE = ("kahan", "light", "plus")
#: float32 rounding unit
U = 2.0**-24
#: Relative error bound of one blocked sum, to first order (update_sums_blocked's
#: docstring): BLOCK roundings in a row, plus about 2**-23 in each factor (the intended
#: update's two products and difference in float32, the change's final rounding).
SUM_BOUND = (BLOCK + 8) * U

#: sizes: whole rows plus a tail (1000 = 3 * 256 + 232), a tail alone, exact rows
SIZES = (1000, 100, 512)


def _run(strategy: str, blocked: bool, monkeypatch) -> tuple[list[torch.Tensor], dict]:
    monkeypatch.setattr(compiled, "blocked_kernel", lambda device, group: blocked)
    monkeypatch.setattr(native, "covers", lambda *args: False)
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(dtype))
              for n in SIZES]
    opt = collage.AdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-5,
                        weight_decay=0.1, strategy=strategy, fused=True, track_updates=True)
    for step in range(3):
        for p in params:
            # magnitudes from 2**-20 to 1e-2: some updates round away, some do not
            scale = torch.exp2(-20 * torch.rand(p.shape, generator=g))
            p.grad = (torch.randn(p.shape, generator=g) * scale * 1e-2).to(dtype)
        opt.step()
    return [p.detach().clone() for p in params], opt.update_stats


@pytest.mark.parametrize("strategy", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_TO_COMPILE else name
    for name in STRATEGIES])
def test_cpu_kernel_measures_like_the_float64_kernel(strategy, monkeypatch):
    weights_cpu, got = _run(strategy, True, monkeypatch)
    weights_64, want = _run(strategy, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(weights_cpu, weights_64))
    assert got.keys() == want.keys()
    for key, value in want.items():
        name = key.split("/")[0]
        if name.startswith("imprecision"):
            assert got[key] == value, key  # counts are exact in both
        elif name.endswith("norm"):
            # a norm is the square root of a sum of squares: half its relative error
            assert math.isclose(got[key], value, rel_tol=SUM_BOUND, abs_tol=0), key
        else:  # edq = <e, d> / ||d||^2, with sum |e d| <= ||e|| ||d|| (Cauchy-Schwarz)
            suffix = key[len(name):]
            ratio = want["effective_norm" + ("_visible" if "visible" in name else "")
                         + suffix] / want["update_norm" + suffix]
            assert abs(got[key] - value) <= 2 * SUM_BOUND * (ratio + abs(value)), key
    if strategy != "fp32":  # steps of ~1e-5 on weights of ~0.02: bf16 loses some, not all
        assert 0 < want["imprecision_visible"] < 1
