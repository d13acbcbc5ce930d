"""fp16 weights with loss scaling through ``torch.amp.GradScaler`` (issue #8, item 3).

The problem: a tiny MLP (8 -> 32 -> 32 -> 1, tanh) fitted full-batch to 1,024 points of a
smooth target, AdamW (lr 1e-2 decaying linearly to 0, no weight decay) on the foreach path.
Full batch makes every run deterministic, and the final loss measures how precisely the
optimizer lands small updates once the gradients become small.

* Every low-precision strategy trains fp16 weights with GradScaler (the optimizer unscales
  in float32 registers and skips on overflow through ``grad_scale``/``found_inf``).
* The failure loss scaling exists for reproduces: with the loss scaled down (a "small loss",
  2**-18 of the MSE) every fp16 gradient underflows to exactly zero and nothing ever moves;
  with GradScaler every parameter gets gradients.
* Acceptance (issue #8): fp16 ``plus`` with GradScaler reaches a final loss within 2% of bf16
  ``plus`` on the same problem. "Within" is one-sided: fp16 carries 3 more significand bits
  than bf16 and may well end *lower*; what must not happen is that fp16 ends higher.

GradScaler protects the backward pass only: the optimizer unscales before it updates its
moments, so they hold *unscaled* magnitudes. These tests are what showed that fp16 cannot hold
them: with fp16 moments, fp16 plus ended at 2.3x bf16 plus's loss and every strategy but
mixed diverged in the small-loss run. Since then the moments of fp16 weights are bf16
(``Strategy.state_dtype``); the tests guard that.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.amp import GradScaler

import collage
from collage.mcf import round_to

from ._support import FP16_STRATEGIES

D_IN, HIDDEN = 8, 32
SMALL_LOSS = 2.0**-18  # (2 r / N) * 2**-18 is below fp16's 2**-25 rounding threshold
SEEDS = (0, 1, 2)


def _problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, D_IN, generator=gen)
    w = torch.randn(D_IN, 1, generator=gen)
    y = torch.tanh(x @ w) + torch.sin(2 * x[:, :1])
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, 1))
    return x, y, model


@functools.lru_cache(maxsize=None)
def train(dtype: torch.dtype, strategy: str, scaled: bool, *, seed: int = 0, steps: int = 400,
          loss_factor: float = 1.0, eps: float = 1e-8) -> dict:
    """Train and return the initial and final (unscaled) loss, and what happened."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead (and contention)
    try:
        return _train(dtype, strategy, scaled, seed, steps, loss_factor, eps)
    finally:
        torch.set_num_threads(threads)


def _train(dtype, strategy, scaled, seed, steps, loss_factor, eps) -> dict:
    x, y, model = _problem(seed)
    model = model.to(dtype)
    opt = collage.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.0, eps=eps,
                        strategy=strategy, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    scaler = GradScaler("cpu", init_scale=2.0**16) if scaled else None
    inputs = x.to(dtype)
    initial_weights = [p.detach().clone() for p in model.parameters()]
    first_grads_nonzero = None
    with torch.no_grad():
        initial = torch.nn.functional.mse_loss(model(inputs).float(), y).item()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(inputs).float(), y) * loss_factor
        (scaler.scale(loss) if scaler else loss).backward()
        if first_grads_nonzero is None:
            first_grads_nonzero = [bool((p.grad != 0).any()) for p in model.parameters()]
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        schedule.step()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(inputs).float(), y).item()
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(initial_weights,
                                                                model.parameters()))
    return {"initial": initial, "final": final, "first_grads_nonzero": first_grads_nonzero,
            "unchanged": unchanged, "skipped": opt.skipped_steps,
            "scale": scaler.get_scale() if scaler else None}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # skipped-step warnings
        yield


@pytest.mark.parametrize("strategy", FP16_STRATEGIES)
def test_fp16_with_grad_scaler_converges(strategy):
    """Every low-precision strategy trains fp16 weights with GradScaler to below 1% of the
    initial loss. Measured: fp32 0.28%, every fp16 strategy 0.28-0.30%; with fp16 moments
    (before they became bf16) the strategies ended at 1.1-1.7%, so 1% separates the two."""
    run = train(torch.float16, strategy, True)
    assert run["scale"] > 0 and run["final"] == run["final"]  # no nan, scaler alive
    assert run["final"] < 0.01 * run["initial"], run


def test_fp16_plus_with_scaling_within_2_percent_of_bf16_plus():
    """Issue #8 acceptance, over three seeds (the sum of final losses, so that one chaotic
    trajectory does not decide)."""
    fp16 = sum(train(torch.float16, "plus", True, seed=s)["final"] for s in SEEDS)
    bf16 = sum(train(torch.bfloat16, "plus", False, seed=s)["final"] for s in SEEDS)
    if fp16 > 1.02 * bf16:  # the acceptance, failed: fp16 mixed (fp32 moments) for contrast
        mixed16 = sum(train(torch.float16, "mixed", True, seed=s)["final"] for s in SEEDS)
        pytest.fail(
            f"fp16 plus + GradScaler ends at {fp16 / bf16:.2f}x the loss of bf16 plus "
            f"(fp16 mixed, whose moments are fp32: {mixed16 / bf16:.2f}x). The optimizer "
            "sees unscaled gradients; if its moments are fp16, (1 - beta2) g**2 < 2**-25 "
            "(|g| < ~8e-3) rounds away and v sinks into fp16's subnormals, so the steps are "
            "too large once the gradients get small. See test_fp16_plus_gap_is_the_state_range")


def test_fp16_plus_gap_is_the_state_range():
    """The control that located the acceptance gap: scaling the loss by 1024 and eps by 1024
    without GradScaler leaves Adam's update unchanged in exact arithmetic but lifts the
    moments 1024x (2**20x for v). With fp16 moments that closed the gap; with any state
    format the fp16 *weights* must be at least as good as bf16 plus (the same 2%)."""
    fp16 = sum(train(torch.float16, "plus", False, seed=s, loss_factor=1024.0,
                     eps=1024 * 1e-8)["final"] for s in SEEDS)
    bf16 = sum(train(torch.bfloat16, "plus", False, seed=s)["final"] for s in SEEDS)
    assert fp16 <= 1.02 * bf16, (fp16, bf16)


@pytest.mark.parametrize("strategy", FP16_STRATEGIES)
def test_without_scaling_fp16_gradients_vanish(strategy):
    """The documented fp16 failure: a small loss (2**-18 x MSE) makes every fp16 gradient
    exactly zero, so no weight ever changes and the loss never improves. GradScaler
    (2**16) brings every parameter's gradient back."""
    unscaled = train(torch.float16, strategy, False, steps=200, loss_factor=SMALL_LOSS)
    scaled = train(torch.float16, strategy, True, steps=200, loss_factor=SMALL_LOSS)
    assert not any(unscaled["first_grads_nonzero"]), "unscaled fp16 gradients did not vanish"
    assert unscaled["unchanged"] and unscaled["final"] == unscaled["initial"]
    assert all(scaled["first_grads_nonzero"]), "GradScaler did not restore the gradients"


@pytest.mark.parametrize("strategy", FP16_STRATEGIES)
def test_small_loss_trains_with_scaling(strategy):
    """...and with GradScaler the small-loss run trains to below 10% of the initial loss
    (measured: 3.5% for every strategy; with fp16 moments all but mixed diverged, ending at
    2-5x the initial loss). Adam is invariant to the loss scale up to eps, so this is the
    same problem as the unscaled-loss one."""
    scaled = train(torch.float16, strategy, True, steps=200, loss_factor=SMALL_LOSS)
    assert scaled["final"] < 0.1 * scaled["initial"], (
        f"with GradScaler the small-loss run went from {scaled['initial']:.3f} to "
        f"{scaled['final']:.3f}. The optimizer holds unscaled moments (|g| ~ 1e-6): in "
        "fp16, m is subnormal and v underflows to 0, and the steps blow up")


@pytest.mark.parametrize("strategy", [s for s in FP16_STRATEGIES if s != "mixed"])
def test_reference_path_unscales_into_the_moments_dtype(strategy):
    """On the reference path the rule computes in the moments' dtype (bf16 for fp16
    weights). Under GradScaler the unscaled gradient must be rounded once into that dtype,
    not first into fp16: an unscaled 2**-26 is below fp16's smallest subnormal (2**-24) but
    well inside bf16's range. (Set ``grad_scale``/``found_inf`` as GradScaler does.)"""
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = collage.AdamW([param], lr=1e-3, strategy=strategy, reference=True)
    param.grad = torch.tensor([2.0**-10, 2.0**-2], dtype=torch.float16)  # scaled by 2**16
    opt.grad_scale, opt.found_inf = torch.tensor(2.0**16), torch.tensor(0.0)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf
    exp_avg = opt.state[param]["exp_avg"]
    assert exp_avg.dtype == torch.bfloat16
    # the reference rule: m = fl(fl(1 - beta1) * g) from m = 0, all in bf16
    one_minus_beta1 = round_to(torch.tensor(0.1, dtype=torch.float64), torch.bfloat16).double()
    expected = round_to(one_minus_beta1 * torch.tensor([2.0**-26, 2.0**-18],
                                                       dtype=torch.float64), torch.bfloat16)
    assert torch.equal(exp_avg, expected), (
        f"first moment {exp_avg.tolist()}, expected {expected.tolist()}: the unscaled "
        "gradient was rounded to fp16 (2**-26 -> 0) before the bf16 arithmetic")
