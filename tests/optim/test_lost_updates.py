"""Issue #3, criterion 2: updates below half an ulp.

A bf16 weight of 1.0 is pushed down by SGD (lr = 1, so the update is exactly ``-grad``) with
gradients in [1e-4, 5e-4] for N = 1000 steps. The weight stays in [0.5, 1), where the bf16
spacing is ulp = 2**-8, so every single update is below half an ulp (2**-9 ~ 1.95e-3) and
plain round-to-nearest loses all of them. The float64 result is ``1 - sum(grads)``, exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import collage

from ._common import BF16, PATHS, represented

N_STEPS = 1000
N_ELEMENTS = 4096
ULP = 2.0**-8  # bf16 spacing in [0.5, 1)
#: the 1% of the issue, taken of the *movement* |w64 - 1| (stricter than 1% of the value:
#: bf16's complete loss is 100% of the movement but only ~10-30% of the value)
MOVEMENT_TOL = 0.01


@dataclass(frozen=True)
class GradientCase:
    name: str
    low: float
    high: float  # gradients uniform in [low, high], then rounded to bf16

    def __str__(self) -> str:
        return self.name

    def grads(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(11)
        u = torch.rand(N_STEPS, N_ELEMENTS, generator=g, dtype=torch.float64)
        grads = (self.low + (self.high - self.low) * u).to(BF16)
        assert float(grads.double().max()) < 2.0**-9  # below half an ulp at every step
        return grads


GRADIENTS = (GradientCase("constant_1e-4", 1e-4, 1e-4), GradientCase("random", 1e-4, 5e-4))


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(N_ELEMENTS, dtype=BF16))


def _run(strategy: str, path: str, grads: torch.Tensor):
    model = Holder()
    opt = collage.SGD(model.parameters(), lr=1.0, strategy=strategy, seed=3, **PATHS[path])
    for step in range(N_STEPS):
        model.w.grad = grads[step].clone()
        opt.step()
    return model, opt


def _float64_result(grads: torch.Tensor) -> torch.Tensor:
    return 1.0 - grads.double().sum(0)


@pytest.mark.parametrize("path", ["reference", "foreach"])
@pytest.mark.parametrize("gradients", GRADIENTS, ids=str)
def test_bf16_loses_every_update(gradients: GradientCase, path: str) -> None:
    model, opt = _run("bf16", path, gradients.grads())
    assert torch.equal(model.w.detach(), torch.ones_like(model.w)), "a bf16 weight moved"
    assert torch.equal(represented(opt, model.w), torch.ones(N_ELEMENTS, dtype=torch.float64))


@pytest.mark.parametrize("path", ["reference", "foreach"])
@pytest.mark.parametrize("strategy", ["kahan", "light", "plus", "split", "mixed"])
@pytest.mark.parametrize("gradients", GRADIENTS, ids=str)
def test_compensated_strategies_land_the_updates(gradients, strategy, path) -> None:
    """Within 1% of the float64 movement (the issue's bound). kahan/light/plus keep what a
    step loses in a bf16 low component |lo| <= 2**-9, which rounds by at most 2**-17 per step:
    the worst case, every rounding the same way, is 7.6e-3 over 1000 steps (2.5% of the
    random movement, 7.6% of the constant one); consecutive roundings of lo do not all go the
    same way (measured 0.75% for the constant gradient, 0.08% for random ones). split and
    mixed round each sum once to float32 (at most 1000 * 2**-25 over the run)."""
    grads = gradients.grads()
    model, opt = _run(strategy, path, grads)
    expected = _float64_result(grads)
    movement = (expected - 1.0).abs()
    full = collage.consolidate(model, opt)["w"]  # public API: the represented value, fp32
    assert full.dtype == torch.float32
    # consolidate rounds the exact represented value once to float32 (2**-24 relative)
    assert torch.allclose(full.double(), represented(opt, model.w), rtol=2.0**-24, atol=0.0)
    error = (full.double() - expected).abs()
    worst = float((error / movement).max())
    print(f"{strategy}/{path}/{gradients}: worst error {worst:.3%} of the movement")
    assert worst <= MOVEMENT_TOL


@pytest.mark.parametrize("path", ["reference", "foreach"])
@pytest.mark.parametrize("gradients", GRADIENTS, ids=str)
def test_stochastic_rounding_is_unbiased_within_a_stated_bound(gradients, path) -> None:
    """Stochastic rounding of ``x`` returns a neighbour with E[result] = x (bias <= 2**-24 ulp
    from the float32 uniform draw, at most 2.4e-7 over 1000 steps: neglected). Per step the
    error X_t satisfies |X_t| <= ulp and Var(X_t | past) = p(1-p) ulp**2 <= ulp**2 / 4, and
    the final error of an element is the martingale sum of its X_t. All elements and steps
    together form one martingale with conditional variance V <= M N ulp**2 / 4, so Freedman's
    inequality P(|S| >= a) <= 2 exp(-a**2 / (2 (V + ulp a / 3))) with a = 6 sqrt(V) gives
    probability < 1e-7 that

        |mean error over M elements| > 6 sqrt(N) (ulp / 2) / sqrt(M)  (= 5.8e-3 here),

    and per element (V = N ulp**2 / 4, then a union bound over 4096 elements: < 1e-3) that
    |error| > 6 sqrt(N) ulp / 2. bf16's systematic loss (0.1 to 0.3 per element) violates the
    first bound by a factor of 17 or more."""
    grads = gradients.grads()
    model, opt = _run("stochastic", path, grads)
    expected = _float64_result(grads)
    assert bool((model.w.detach() >= 0.5).all()) and bool((model.w.detach() <= 1.0).all())
    error = represented(opt, model.w) - expected
    mean_bound = 6 * math.sqrt(N_STEPS) * (ULP / 2) / math.sqrt(N_ELEMENTS)
    element_bound = 6 * math.sqrt(N_STEPS) * (ULP / 2)
    mean_error = float(error.mean())
    print(f"stochastic/{path}/{gradients}: mean error {mean_error:.2e} (bound {mean_bound:.2e}),"
          f" max |error| {float(error.abs().max()):.2e} (bound {element_bound:.2e})")
    assert abs(mean_error) <= mean_bound
    assert float(error.abs().max()) <= element_bound
    assert float((1.0 - expected).mean()) > 17 * mean_bound  # the bound can tell loss apart
