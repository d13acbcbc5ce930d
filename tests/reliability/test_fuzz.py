"""Property-based fuzzing of the optimizer step with extreme values (issue #8, item 2).

Inputs: weights and gradients drawn over *all* finite values of the weight dtype (uniform in
the bit fields, so every binade, subnormals included, is as likely as any other), mixed with
signed zeros, the smallest subnormal, the largest finite value and moderate values; lr from 0
and 1e-30 up to 1e4, eps from 0 to 1, weight decay, betas from (0, 0) to (0.99, 0.9999);
one to three steps, sometimes with a nan/inf injected into one gradient element.

Properties checked after every step:

1. no exception for valid input;
2. ``nonfinite='skip'`` and a non-finite gradient: every weight, compensation term, state,
   step counter and generator is bitwise unchanged, ``skipped_steps`` grows by one;
3. ``lr = 0``: the weight and its compensation terms are bitwise unchanged, except that a
   zero may change sign (-0.0 + +0.0 = +0.0 in IEEE arithmetic, as in torch.optim); the
   moments may move (they do in torch.optim too). Not claimed with eps = 0 and a zero
   second moment (0/0 is nan even at lr = 0) or with an overflowing state (0 * inf is nan):
   both as in torch.optim; the first is tested below;
4. finite weights, states and gradients give finite weights, compensation and states,
   unless the *oracle* (a float64 evaluation of the rule from the represented state) says an
   overflow is involved, or the case is one of the documented non-guarantees (a second
   moment that underflows its storage format while eps is 0 or too small to keep the update
   finite; see docs/reliability.md);
5. a weight whose exact new value is beyond twice the largest finite value is reported as
   non-finite, never saturated;
6. the normalisation invariants of test_invariants.py.

Default run: 75 examples per (strategy, path) for AdamW (150 per strategy), 30 for SGD and
Lion on a subset of strategies. ``pytest -m slow`` runs the issue's 2,000 per (strategy,
path) for AdamW and 500 for SGD/Lion (``COLLAGE_RELIABILITY_FULL=1`` gives the default tests
those sizes too). Examples are derandomized: every run draws the same cases.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import collage
from collage.mcf import format_info, round_to
from collage.optim.strategies import get_strategy

from ._support import (
    ALL_STRATEGIES,
    FULL,
    PATHS,
    assert_unchanged,
    bits_equal,
    normalisation_violations,
    path_kwargs,
    represented,
    snapshot,
    weight_dtypes,
)

N = 3  # elements per tensor: enough for mixed signs, small enough for thousands of cases
WEIGHT_SIDE = ("weight_lo", "compensation", "master", "weight_low_bits")

_LAYOUT = {  # exponent bits, stored mantissa bits
    torch.float32: (8, 23),
    torch.bfloat16: (8, 7),
    torch.float16: (5, 10),
}


def _from_fields(dtype: torch.dtype, sign: int, exponent: int, mantissa: int) -> float:
    ebits, mbits = _LAYOUT[dtype]
    bias = 2 ** (ebits - 1) - 1
    if exponent == 0:
        magnitude = mantissa * 2.0 ** (1 - bias - mbits)
    else:
        magnitude = (1 + mantissa / 2**mbits) * 2.0 ** (exponent - bias)
    return -magnitude if sign else magnitude


def finite_values(dtype: torch.dtype, wide: bool = True):
    """One finite value of ``dtype`` (as a Python float, exactly representable).

    Equally likely sources: any finite bit pattern (every binade equally likely); twice a
    bit pattern below 2**(emax/4) (subnormals up to large values whose squares still fit);
    specials (signed zeros, smallest subnormal and normal, +-1); the extremes +-max_finite;
    and twice a moderate value in [-4, 4]. ``wide=False`` leaves out the full-range bit
    patterns and the extremes: half of the examples are drawn that way, so that the
    finiteness property (which overflowing cases are exempt from) is exercised often."""
    info = format_info(dtype)
    ebits, mbits = _LAYOUT[dtype]
    bias = 2 ** (ebits - 1) - 1

    def by_bits(top_exponent_field: int):
        return st.builds(_from_fields, st.just(dtype), st.integers(0, 1),
                         st.integers(0, top_exponent_field), st.integers(0, 2**mbits - 1))

    full = by_bits(2**ebits - 2)
    lower = by_bits(bias + bias // 4)
    special = st.sampled_from([
        0.0, -0.0, info.smallest_subnormal, -info.smallest_subnormal, info.smallest_normal,
        1.0, -1.0,
    ])
    extreme = st.sampled_from([info.max_finite, -info.max_finite])
    moderate = st.floats(-4.0, 4.0, width=32).map(
        lambda x: float(round_to(torch.tensor(x, dtype=torch.float64), dtype)))
    if not wide:
        return st.one_of(lower, lower, special, moderate, moderate)
    return st.one_of(full, lower, lower, special, extreme, moderate, moderate)


def tensors(dtype: torch.dtype, wide: bool = True):
    return st.lists(finite_values(dtype, wide), min_size=N, max_size=N)


LRS = st.one_of(st.sampled_from([0.0, 1e-30, 1e-8, 1e-3, 0.1, 1.0, 1e4]),
                st.floats(0.0, 1.0))
EPSS = st.sampled_from([0.0, 1e-30, 1e-12, 1e-8, 1e-3, 1.0])
WDS = st.sampled_from([0.0, 1e-4, 0.1, 1.0])
BETAS = st.sampled_from([(0.9, 0.999), (0.0, 0.0), (0.5, 0.9), (0.99, 0.9999), (0.9, 0.99)])
INJECT = st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, N - 1),
                                        st.sampled_from([math.nan, math.inf, -math.inf])))


# --------------------------------------------------------------------------------------------
# The float64 oracle
# --------------------------------------------------------------------------------------------


class Verdict:
    """What the oracle allows for one step: ``overflow`` (non-finite results allowed),
    ``undefined`` (documented non-guarantee: non-finite allowed), ``must_overflow`` (elements
    whose exact new weight is far beyond the range: must come out non-finite)."""

    def __init__(self, overflow: bool, undefined: bool, must_overflow: torch.Tensor):
        self.overflow, self.undefined, self.must_overflow = overflow, undefined, must_overflow


def _limits(strategy: str, dtype: torch.dtype, path: str):
    """(largest finite value of the weight format, the states' format, the format the
    rule's arithmetic runs in): the reference path computes in the states' dtype (bf16 for
    fp16 weights, whose moments are bf16), the float32-register paths in float32."""
    states = get_strategy(strategy).state_dtype(dtype)
    arith = states if path == "reference" else torch.float32
    return format_info(dtype).max_finite, states, arith


def _oracle(rule: str, strategy: str, dtype: torch.dtype, path: str, group: dict, step: int,
            weight: torch.Tensor, state: dict, grad: torch.Tensor) -> Verdict:
    """Evaluate one step exactly enough (float64) from the represented state.

    Overflow is *involved* when any exact quantity the kernels compute (the gradient, its
    square, the moments, the update, the step size, the new weight, ...) is within a factor
    of 4 of the largest finite value: a few roundings (relative <= 2**-8 each) cannot move a
    value by 4x, so outside that margin the kernels must not overflow, and inside it they
    may. Values are float64; products of two factors below 2**1024 cannot overflow there.
    """
    limit, state_dtype, arith = _limits(strategy, dtype, path)
    W = represented(strategy, weight, state)
    g = grad.double()
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    quantities = [g, g * g, W, W * (lr * wd)]
    undefined = False
    if rule == "adamw":
        b1, b2 = group["betas"]
        eps = float(group["eps"])
        m = state.get("exp_avg", torch.zeros_like(g)).double()
        v = state.get("exp_avg_sq", torch.zeros_like(g)).double()
        if "exp_avg_sq_lo" in state:
            v = v + state["exp_avg_sq_lo"].double()
        m1 = b1 * m + (1 - b1) * g
        v1 = b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        step_size = lr / bc1
        denom = v1.sqrt() / math.sqrt(bc2) + eps
        with torch.no_grad():
            u = torch.where(m1 == 0, torch.zeros_like(m1), -step_size * m1 / denom)
        # A second moment below 16x the smallest normal of its storage format may be stored
        # as a subnormal or as zero (an fp16 v underflows for |g| < ~8e-3; above 16x the
        # smallest normal, three steps of rounding cost a relative 2**-10 at most): then the
        # update is bounded only by step_size * |m| / eps, which must then stay in range.
        # With eps == 0 the update is 0/0 or m/0: undefined, exactly as in torch.optim.AdamW.
        # A positive eps that rounds to 0 in the arithmetic (fp16 reference path: eps <
        # 2**-25) is *not* excused: the user asked for eps > 0.
        eps_arith = float(round_to(torch.tensor(eps, dtype=torch.float64), arith))
        tiny = format_info(state_dtype).smallest_normal * 16
        if arith != torch.float32:
            tiny = max(tiny, format_info(arith).smallest_normal * 16)
        under = v1 < 2 * tiny  # 2x: a stored v below tiny may have been flushed to 0
        if bool(under.any()):
            if eps == 0.0:
                undefined = True  # the user's eps = 0: m/0 or 0/0, as in torch.optim.AdamW
            elif eps_arith > 0.0:
                # the computed m differs from m1 by a few roundings of its two terms
                slack = 2.0**-6 * (b1 * m.abs() + (1 - b1) * g.abs())
                worst = step_size * (m1.abs() + slack) / eps_arith
                quantities.append(torch.where(under, worst, torch.zeros_like(worst)))
        quantities += [m, v, m1, v1, (1 - b2) * g * g, u, torch.tensor(step_size),
                       step_size * m1]
        W1 = W * (1 - lr * wd) + u
    elif rule == "sgd":
        momentum, dampening = group["momentum"], group["dampening"]
        d = g + wd * W if wd else g
        buf = state.get("momentum_buffer", torch.zeros_like(g)).double()
        if momentum:
            buf1 = d if step == 1 else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf1 if group["nesterov"] else buf1
            quantities += [buf, buf1]
        u = -lr * d
        quantities += [d, u, torch.tensor(lr)]
        W1 = W + u
    else:  # lion
        b1, b2 = group["betas"]
        m = state.get("exp_avg", torch.zeros_like(g)).double()
        if "exp_avg_lo" in state:
            m = m + state["exp_avg_lo"].double()
        quantities += [m, b1 * m + (1 - b1) * g, b2 * m + (1 - b2) * g, torch.tensor(lr)]
        W1 = W * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
    quantities.append(W1)
    biggest = max(float(q.abs().max()) for q in quantities)
    overflow = not math.isfinite(biggest) or biggest > limit / 4
    return Verdict(overflow, undefined, W1.abs() > 2 * limit)


# --------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------


def _all_finite(param, state) -> bool:
    tensors_ = [param.detach()] + [v for k, v in state.items()
                                   if isinstance(v, torch.Tensor) and k != "step"]
    return all(bool(torch.isfinite(t).all()) for t in tensors_ if t.is_floating_point())


def _weight_side(param, state) -> list[torch.Tensor]:
    return [param.detach().clone()] + [state[k].clone() for k in WEIGHT_SIDE if k in state]


def same_except_zero_sign(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Bitwise equal, except that a zero may change sign (IEEE: -0 + +0 = +0; torch.optim
    does the same). Integer tensors (split's low bits) must be bitwise equal."""
    if not before.is_floating_point():
        return torch.equal(before, after)
    zero = before == 0
    return (bits_equal(torch.where(zero, 0.0, before).to(before.dtype),
                       torch.where(zero, 0.0, after).to(after.dtype))
            and bool((after[zero] == 0).all()))


def check_steps(rule, strategy, path, dtype, weights, grads, inject, lr, eps, wd, betas,
                sgd_opts=None):
    param = torch.nn.Parameter(torch.tensor(weights, dtype=torch.float64).to(dtype))
    if rule == "adamw":
        opt = collage.AdamW([param], lr=lr, eps=eps, weight_decay=wd, betas=betas,
                            strategy=strategy, **path_kwargs(path))
    elif rule == "sgd":
        momentum, nesterov = sgd_opts
        opt = collage.SGD([param], lr=lr, momentum=momentum, nesterov=nesterov,
                          weight_decay=wd, strategy=strategy, **path_kwargs(path))
    else:
        opt = collage.Lion([param], lr=lr, betas=betas, weight_decay=wd, strategy=strategy,
                           **path_kwargs(path))
    group = opt.param_groups[0]
    finite_so_far = all(math.isfinite(x) for x in weights)
    steps_done = 0
    for index, values in enumerate(grads):
        grad = torch.tensor(values, dtype=torch.float64).to(dtype)
        if inject is not None and inject[0] == index:
            grad[inject[1]] = inject[2]
        param.grad = grad
        state = opt.state[param]
        before = snapshot(opt)
        state_before = {k: v.clone() for k, v in state.items()}
        weight_before = _weight_side(param, state)
        if not bool(torch.isfinite(grad).all()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
            assert_unchanged(before, opt, skipped_delta=1)  # property 2
            continue
        verdict = None
        if finite_so_far:
            verdict = _oracle(rule, strategy, dtype, path, group, steps_done + 1, param,
                              state_before, grad)
        opt.step()  # property 1: no exception
        steps_done += 1
        state = opt.state[param]
        if (lr == 0.0 and verdict is not None  # property 3
                and not (verdict.undefined or verdict.overflow)):
            after = _weight_side(param, state)
            for b, a in zip(weight_before, after):
                assert same_except_zero_sign(b, a), (
                    f"lr=0 changed the weight: {b.tolist()} -> {a.tolist()}")
        if verdict is not None:
            if not (verdict.overflow or verdict.undefined):  # property 4
                assert _all_finite(param, state), (
                    f"finite inputs gave non-finite results: weight {param.tolist()}, state "
                    f"{ {k: v.tolist() for k, v in state.items()} }")
            bad = verdict.must_overflow & torch.isfinite(param.detach())
            assert not bool(bad.any()), (  # property 5
                f"overflow hidden: exact new weight beyond the range but got {param.tolist()}")
        failures = normalisation_violations(strategy, param, state)  # property 6
        assert not failures, "; ".join(failures)
        finite_so_far = finite_so_far and _all_finite(param, state)


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


def _settings(default: int, full: int):
    """Derandomized (the same cases every run). The default run does not shrink a failing
    case (shrinking one costs a minute here); the full run does."""
    phases = list(Phase) if FULL or default == full else [
        p for p in Phase if p is not Phase.shrink]
    return settings(max_examples=full if FULL else default, derandomize=True, deadline=None,
                    phases=phases, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _adamw_case(strategy: str, path: str, examples: int, full: int):
    @_settings(examples, full)
    @given(data=st.data())
    def run(data):
        dtype = data.draw(st.sampled_from(weight_dtypes(strategy)), label="dtype")
        wide = data.draw(st.sampled_from([False, False, True]), label="wide")
        weights = data.draw(tensors(dtype, wide), label="weights")
        grads = data.draw(st.lists(tensors(dtype, wide), min_size=1, max_size=3), label="grads")
        check_steps("adamw", strategy, path, dtype, weights, grads,
                    data.draw(INJECT, label="inject"), data.draw(LRS, label="lr"),
                    data.draw(EPSS, label="eps"), data.draw(WDS, label="weight_decay"),
                    data.draw(BETAS, label="betas"))
    return run


def _other_case(rule: str, strategy: str, path: str, examples: int, full: int):
    @_settings(examples, full)
    @given(data=st.data())
    def run(data):
        dtype = data.draw(st.sampled_from(weight_dtypes(strategy)), label="dtype")
        wide = data.draw(st.sampled_from([False, False, True]), label="wide")
        weights = data.draw(tensors(dtype, wide), label="weights")
        grads = data.draw(st.lists(tensors(dtype, wide), min_size=1, max_size=3), label="grads")
        sgd_opts = None
        if rule == "sgd":
            momentum = data.draw(st.sampled_from([0.0, 0.9]), label="momentum")
            nesterov = momentum > 0 and data.draw(st.booleans(), label="nesterov")
            sgd_opts = (momentum, nesterov)
        check_steps(rule, strategy, path, dtype, weights, grads,
                    data.draw(INJECT, label="inject"), data.draw(LRS, label="lr"), 0.0,
                    data.draw(WDS, label="weight_decay"), data.draw(BETAS, label="betas"),
                    sgd_opts)
    return run


OTHER_STRATEGIES = ("bf16", "kahan", "stochastic", "plus", "split")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_fuzz_adamw(strategy, path):
    _adamw_case(strategy, path, 75, 2000)()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_fuzz_sgd_lion(rule, strategy, path):
    _other_case(rule, strategy, path, 30, 500)()


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_fuzz_adamw_2000(strategy, path):
    """The issue's size: 2,000 seeded, reproducible cases per strategy and path."""
    _adamw_case(strategy, path, 2000, 2000)()


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_fuzz_sgd_lion_500(rule, strategy, path):
    _other_case(rule, strategy, path, 500, 500)()


# --------------------------------------------------------------------------------------------
# Targeted edge cases: lr = 0, eps = 0
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["reference", "per_tensor", "foreach", "default"])
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("rule", ["adamw", "sgd", "lion"])
def test_lr_zero_changes_no_weight(rule, strategy, path):
    """After a few real steps (so that compensation terms, masters and moments are not
    trivial), steps at lr = 0 (weight decay included: lr * wd = 0) leave the weight and every
    compensation term bitwise unchanged, signed zeros aside: the pairs are kept canonical
    (the weight is the nearest of hi + lo, ties to even), so a zero update flips none. 70,000
    weights of randn * 4: before the pairs were canonical, 60-75 of them moved (issue #25);
    the default path is the native one for AdamW on CPU."""
    dtype = weight_dtypes(strategy)[0]
    gen = torch.Generator().manual_seed(1)
    weights = torch.cat([torch.randn(69998, generator=gen) * 4, torch.tensor([0.0, -0.0])])
    param = torch.nn.Parameter(weights.to(dtype))
    cls = {"adamw": collage.AdamW, "sgd": collage.SGD, "lion": collage.Lion}[rule]
    extra = {"momentum": 0.9} if rule == "sgd" else {}
    opt = cls([param], lr=1e-2, weight_decay=0.1, strategy=strategy, **extra,
              **path_kwargs(path))
    for _ in range(3):
        param.grad = torch.randn(70000, generator=gen).to(dtype)
        opt.step()
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = _weight_side(param, opt.state[param])
    for _ in range(3):
        param.grad = torch.randn(70000, generator=gen).to(dtype)
        opt.step()
        for b, a in zip(before, _weight_side(param, opt.state[param])):
            assert same_except_zero_sign(b, a), "lr=0 changed a weight or compensation term"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_lr_zero_signed_zero(strategy, path):
    """The one bit lr = 0 may change: -0.0 + (+0.0) = +0.0 (IEEE 754), exactly what
    torch.optim.AdamW does; the value stays zero."""
    dtype = weight_dtypes(strategy)[0]
    param = torch.nn.Parameter(torch.tensor([-0.0, 0.0], dtype=dtype))
    opt = collage.AdamW([param], lr=0.0, strategy=strategy, **path_kwargs(path))
    param.grad = torch.tensor([-1.0, 1.0], dtype=dtype)  # updates -0.0 * (-m) = +0.0, -0.0
    opt.step()
    assert param.detach().tolist() == [0.0, 0.0]  # the value is unchanged
    if strategy == "fp32":  # and the bits are torch.optim's
        reference = torch.nn.Parameter(torch.tensor([-0.0, 0.0]))
        torch_opt = torch.optim.AdamW([reference], lr=0.0, foreach=False)
        reference.grad = torch.tensor([-1.0, 1.0])
        torch_opt.step()
        assert bits_equal(param.detach(), reference.detach())


@pytest.mark.parametrize("path", ["foreach", "fused"])  # reference: the research form
@pytest.mark.parametrize("lr", [0.0, 1e-3])
def test_eps_zero_is_torch_semantics(lr, path):
    """eps = 0 is valid input. Where the second moment is zero (a zero gradient) or
    underflows (|g| < ~1e-19: g*g is below float32's range) Adam's update is 0/0 or m/0, nan
    or inf, even at lr = 0. The fp32 strategy does bitwise what torch.optim.AdamW does; this
    is documented as not guaranteed (docs/reliability.md), not hidden."""
    grads = [torch.tensor([0.0, 1e-30, 1.0, -1e-25]), torch.tensor([0.0, 0.0, 0.5, 1.0])]
    ours = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt = collage.AdamW([ours], lr=lr, eps=0.0, strategy="fp32", **path_kwargs(path))
    torch_opt = torch.optim.AdamW([theirs], lr=lr, eps=0.0, foreach=False)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
        assert bits_equal(ours.detach(), theirs.detach()), (ours.tolist(), theirs.tolist())
    assert math.isnan(ours[0].item())  # 0/0: reported as nan, not hidden
    assert math.isfinite(ours[2].item())
