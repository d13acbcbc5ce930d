"""Invariants that hold after every optimizer step (issue #8, item 1).

* Normalisation: every two-component value is non-overlapping, ``|lo| <= ulp(hi)/2`` with
  the ulp taken in the component dtype at the *hi* component (``collage.mcf.ulp``): the
  weight pair of light/plus, the second-moment pair of plus/split (Lion's momentum pair), the
  split master against its visible bf16 weight; mixed's model weight is its master rounded.
* Finite in, finite out: finite weights and gradients in ranges where nothing overflows give
  finite weights, compensation terms and states.
* Overflow is reported, never hidden: a weight pushed past the format's largest finite value
  becomes +-inf with the right sign (not saturated at max_finite), the represented value is
  +-inf too (not nan), and it stays +-inf on the next step.

Every strategy, the foreach and the reference path; the fused (compiled) path for one
strategy (compiling costs seconds per kernel).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import collage
from collage.mcf import format_info, round_to, ulp

from ._support import (
    ALL_STRATEGIES,
    FP16_STRATEGIES,
    LOW_PRECISION,
    PATHS,
    dtype_id,
    max_finite,
    normalisation_violations,
    overflow_threshold,
    path_kwargs,
    represented,
    strategy_dtype_params,
    weight_dtypes,
)

# Rule configurations exercised: AdamW with decoupled weight decay and beta2 close to 1 (the
# plus second moment), SGD with momentum and coupled decay, Lion (slow EMA as an MCF pair).
RULE_CONFIGS = {
    "adamw": (collage.AdamW, dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)),
    "sgd": (collage.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    "lion": (collage.Lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


def _interesting_weights(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Weights that make rounding interesting: exact powers of two and their lower
    neighbours (where a rounded sum may round *up* to a power of two, whose ulp is twice the
    ulp below it), subnormals, signed zeros, and normal values across 12 binades."""
    info = format_info(dtype)
    k = torch.randint(-8, 8, (n,), generator=gen).double()
    powers = torch.exp2(k)
    below = powers * (1 - 2.0 ** -info.precision)  # the largest value below 2**k
    sub = info.smallest_subnormal * torch.randint(1, 64, (n,), generator=gen).double()
    normal = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-6, 6, (n,), generator=gen).double())
    zeros = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, -0.0).double()
    pick = torch.randint(0, 5, (n,), generator=gen)
    values = torch.stack([powers, below, sub, normal, zeros])[pick, torch.arange(n)]
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return round_to(values * torch.where(pick == 4, 1.0, sign), dtype)


def _gradient(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gradients of log-uniform magnitude in [1e-6, 10] (fp16: 1e-6 is a subnormal; the
    moments of fp16 weights are bf16, so their squares do not underflow)."""
    low = -6.0
    magnitude = 10 ** (low + (1 - low) * torch.rand(n, generator=gen, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return round_to(magnitude * sign, dtype)


def _run_and_check(rule: str, strategy: str, dtype: torch.dtype, path: str, *, n: int,
                   steps: int, seed: int = 0) -> None:
    cls, kwargs = RULE_CONFIGS[rule]
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(_interesting_weights(n, dtype, gen))
    opt = cls([param], strategy=strategy, **kwargs, **path_kwargs(path))
    for step in range(steps):
        param.grad = _gradient(n, dtype, gen)
        opt.step()
        state = opt.state[param]
        failures = normalisation_violations(strategy, param, state)
        assert not failures, f"step {step + 1}: " + "; ".join(failures)
        for key, value in [("weight", param.detach()), *state.items()]:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert bool(torch.isfinite(value).all()), (
                    f"step {step + 1}: {key} became non-finite from finite inputs")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rule", list(RULE_CONFIGS))
@pytest.mark.parametrize(("strategy", "dtype"), strategy_dtype_params())
def test_normalised_and_finite_after_every_step(rule, strategy, dtype, path):
    steps, n = (40, 2048) if path == "foreach" else (25, 1024)
    _run_and_check(rule, strategy, dtype, path, n=n, steps=steps)


@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_normalised_fused_plus(rule):
    """The compiled kernel keeps the same invariants (plus: both MCF pairs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fallback warning where no compiler
        _run_and_check(rule, "plus", torch.bfloat16, "fused", n=512, steps=10)


# --------------------------------------------------------------------------------------------
# Normalisation exactly at power-of-two boundaries
# --------------------------------------------------------------------------------------------


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    strategy=st.sampled_from(["light", "plus"]),
    path=st.sampled_from(PATHS),
    exponent=st.integers(-10, 10),
    start=st.sampled_from(["power", "below", "above"]),
    numerator=st.integers(-40, 40),
    shift=st.integers(1, 12),
    steps=st.integers(1, 3),
)
def test_pair_normalised_across_powers_of_two(dtype, strategy, path, exponent, start,
                                              numerator, shift, steps):
    """Plain SGD (lr = 1, no momentum) adds exactly ``-g`` to the pair, so the represented
    value can be steered to within a fraction of an ulp of a power of two from either side:
    a value just below 2**k rounds *up* to hi = 2**k, whose ulp is twice the spacing below
    it; ``|lo| <= ulp(hi)/2`` must hold on both sides."""
    info = format_info(dtype)
    power = 2.0**exponent
    spacing_below = power * 2.0 ** -info.precision
    w0 = {"power": power, "below": power - spacing_below,
          "above": power + 2 * spacing_below}[start]
    # a step of numerator/2**shift ulps below the power: a multiple of a fraction of an ulp
    delta = numerator * spacing_below * 2.0**-shift
    param = torch.nn.Parameter(torch.tensor([w0, -w0], dtype=torch.float64).to(dtype))
    opt = collage.SGD([param], lr=1.0, strategy=strategy, **path_kwargs(path))
    for _ in range(steps):
        param.grad = round_to(torch.tensor([delta, -delta], dtype=torch.float64), dtype)
        opt.step()
        failures = normalisation_violations(strategy, param, opt.state[param])
        assert not failures, "; ".join(failures)


# --------------------------------------------------------------------------------------------
# Overflow is reported, not hidden
# --------------------------------------------------------------------------------------------


def _overflow_setup(dtype: torch.dtype):
    """Weights [max, -max, 1] and a learning rate whose first AdamW step (|update| ~= lr:
    m / sqrt(v) = +-1 after bias correction) pushes the first two well past the overflow
    threshold; float32 registers overflow too for bf16/fp32 (max + lr > float32 max)."""
    big = max_finite(dtype)
    lr = {torch.float16: 100.0, torch.bfloat16: 1e37, torch.float32: 1e37}[dtype]
    weights = torch.tensor([big, -big, 1.0], dtype=torch.float64).to(dtype)
    grad = torch.tensor([-1.0, 1.0, 1.0], dtype=dtype)  # +lr, -lr, -lr
    return weights, grad, lr


def _overflow_params(strategies=ALL_STRATEGIES):
    return [pytest.param(s, d, p, id=f"{s}-{dtype_id(d)}-{p}")
            for s, d in [(s, d) for s in strategies for d in weight_dtypes(s)]
            for p in PATHS]


@pytest.mark.parametrize(("strategy", "dtype", "path"),
                         _overflow_params() + [pytest.param("plus", torch.bfloat16, "fused",
                                                            id="plus-bf16-fused")])
def test_weight_overflow_is_reported_as_inf(strategy, dtype, path):
    weights, grad, lr = _overflow_setup(dtype)
    param = torch.nn.Parameter(weights.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt = collage.AdamW([param], lr=lr, weight_decay=0.0, strategy=strategy,
                            **path_kwargs(path))
        param.grad = grad.clone()
        opt.step()
        w = param.detach().double()
        # the visible weight: +-inf, not saturated at +-max_finite
        assert w[0] == math.inf and w[1] == -math.inf, f"weight saturated/hidden: {w.tolist()}"
        assert math.isfinite(w[2]), w.tolist()
        value = represented(strategy, param, opt.state[param])
        true0 = float(weights[0]) + lr  # the exact value of the overflowed element
        if true0 <= torch.finfo(torch.float32).max and strategy == "mixed":
            # mixed keeps an fp32 master, which holds the true value: only the copy overflows
            assert value[0] == pytest.approx(true0, rel=2**-23)
            assert value[1] == pytest.approx(-true0, rel=2**-23)
        else:
            assert value[0] == math.inf and value[1] == -math.inf, (
                f"represented value after overflow is {value.tolist()[:2]}, expected "
                "[inf, -inf]: the compensation term does not follow the non-finite rule "
                "(hi + lo = inf + -inf = nan)")
        # one more step with a small learning rate: the overflow stays +-inf, it does not
        # decay into nan (the non-finite rule: trailing components are +0 next to inf)
        for group in opt.param_groups:
            group["lr"] = 1e-3
        param.grad = torch.tensor([0.5, -0.5, 1.0], dtype=dtype)
        opt.step()
        w = param.detach().double()
        assert w[0] == math.inf and w[1] == -math.inf, (
            f"the overflowed weight became {w.tolist()[:2]} on the next step, expected "
            "[inf, -inf]")
        assert math.isfinite(w[2])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_second_moment_overflow_is_reported(strategy, path):
    """A gradient of 1e30 (finite in bf16 and float32) makes ``(1 - beta2) g**2 = 1e57``,
    beyond every state format (bf16 and float32 alike). The stored second moment shows +inf
    (not saturated), and stays +inf on the next step: a decayed inf is inf, not nan. The
    weight is untouched then (m / inf = 0), which only the state shows."""
    dtype = weight_dtypes(strategy)[0]
    param = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=dtype))
    opt = collage.AdamW([param], lr=1e-3, weight_decay=0.0, strategy=strategy,
                        **path_kwargs(path))
    param.grad = torch.tensor([1e30, 1.0], dtype=dtype)
    opt.step()
    v = represented_moment(opt.state[param])
    assert v[0] == math.inf, f"second moment saturated/hidden: {v.tolist()}"
    assert math.isfinite(v[1])
    param.grad = torch.tensor([0.0, 1.0], dtype=dtype)
    opt.step()
    v = represented_moment(opt.state[param])
    assert v[0] == math.inf, (
        f"the overflowed second moment became {v[0].item()} on the next step, expected inf "
        "(beta2 * inf = inf; an MCF pair (inf, -inf) sums to nan)")
    assert math.isfinite(v[1])
    assert bool(torch.isfinite(param.detach()).all()), param.tolist()


def represented_moment(state: dict) -> torch.Tensor:
    """The second moment a state represents (hi + lo for the MCF pair), in float64."""
    v = state["exp_avg_sq"].double()
    if "exp_avg_sq_lo" in state:
        v = v + state["exp_avg_sq_lo"].double()
    return v


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", FP16_STRATEGIES)
def test_fp16_small_gradient_stays_finite(strategy, path):
    """Finite in, finite out, with the default hyperparameters: fp16 weights, gradients of
    1e-4 and 0 (an unused parameter) and eps = 1e-8. Nothing here overflows in exact
    arithmetic (the intended update is about -lr, or 0). A regression guard: with the
    moments in fp16, eps = 1e-8 rounded to 0 and g*g = 1e-8 underflowed, so the reference
    path divided by zero; fp16 weights now keep bf16 moments."""
    param = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5], dtype=torch.float16))
    opt = collage.AdamW([param], strategy=strategy, **path_kwargs(path))  # defaults
    for _ in range(3):
        param.grad = torch.tensor([1e-4, -1e-4, 0.0], dtype=torch.float16)
        opt.step()
        state = opt.state[param]
        values = {"weight": param.detach(), **{k: v for k, v in state.items() if k != "step"}}
        bad = {k: v.tolist() for k, v in values.items()
               if v.is_floating_point() and not bool(torch.isfinite(v).all())}
        assert not bad, f"non-finite from finite inputs: {bad}"


@pytest.mark.parametrize(("strategy", "dtype"), strategy_dtype_params(LOW_PRECISION))
def test_reference_and_foreach_agree_on_overflow_sign(strategy, dtype):
    """Both paths report the same overflow: same signs of infinity in the visible weight."""
    weights, grad, lr = _overflow_setup(dtype)
    results = []
    for path in PATHS:
        param = torch.nn.Parameter(weights.clone())
        opt = collage.AdamW([param], lr=lr, weight_decay=0.0, strategy=strategy,
                            **path_kwargs(path))
        param.grad = grad.clone()
        opt.step()
        results.append(param.detach()[:2].double())
    assert torch.equal(results[0], results[1])
    assert results[0].tolist() == [math.inf, -math.inf]


def test_ulp_of_hi_is_the_bound_used():
    """Sanity check of the bound itself: bf16 at 1.0, ulp = 2**-7 and the largest value
    below 1.0 is 1 - 2**-8 (the spacing below a power of two is half the ulp at it)."""
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    below = torch.tensor(1 - 2**-8, dtype=torch.bfloat16)
    assert float(ulp(one)) == 2**-7
    assert float(ulp(below)) == 2**-8
    assert float(below) == 1 - 2**-8
    assert overflow_threshold(torch.float16) == 65520.0


def test_normalisation_checker_catches_a_bad_pair():
    """The checker used above is not vacuous: an overlapping pair, a pair that is not
    canonical (its sum rounds to another weight: a tie beside an odd weight, or a low part
    that reaches the next value below a power of two) and a mis-rounded mixed copy are
    reported."""
    w = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    # a tie beside an even weight stays; 2 - 2**-9 rounds to 2
    good = {"weight_lo": torch.tensor([2.0**-8, -(2.0**-9)], dtype=torch.bfloat16)}
    assert normalisation_violations("light", w, good) == []
    bad = {"weight_lo": torch.tensor([2.0**-7, 0.0], dtype=torch.bfloat16)}
    assert len(normalisation_violations("light", w, bad)) == 1
    # 2 - 2**-7 is the bf16 value below 2: that pair is not canonical
    below = {"weight_lo": torch.tensor([0.0, -(2.0**-7)], dtype=torch.bfloat16)}
    assert len(normalisation_violations("light", w, below)) == 1
    odd = torch.tensor([1.0 + 2.0**-7], dtype=torch.bfloat16)  # a tie beside an odd weight
    tie = {"weight_lo": torch.tensor([2.0**-8], dtype=torch.bfloat16)}
    assert len(normalisation_violations("light", odd, tie)) == 1
    assert len(normalisation_violations("kahan", odd, {"compensation": tie["weight_lo"]})) == 1
    v = {"exp_avg_sq": torch.tensor([1.0], dtype=torch.bfloat16),
         "exp_avg_sq_lo": torch.tensor([-(2.0**-6)], dtype=torch.bfloat16)}
    assert len(normalisation_violations("plus", w[:1], v)) == 1
    master = {"master": torch.tensor([1.0 + 2.0**-7, 2.0], dtype=torch.float32)}
    assert len(normalisation_violations("mixed", w, master)) == 1
