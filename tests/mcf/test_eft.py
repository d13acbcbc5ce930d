"""Every MCF primitive, for every component dtype, against the exact reference (exact.py).

Exactness is equality: bit patterns for leading components (so signed zeros count), values
for error terms (IEEE leaves the sign of a zero error unspecified), and +0 bit patterns for
trailing components whose leading one is not finite (the non-finite rule). Error *bounds* are
checked exactly with :func:`exact.sum_sign`, never with a tolerance.

Inputs: float8 formats exhaustively over all 256 x 256 pairs; bfloat16/float16 with every one
of the 65536 values of ``a`` against ~200 structured + random ``b``; float32 on large random
samples. Every dtype also gets adversarial pairs: ties, cancellation, magnitude gaps of 0..60
binades (clipped to the format), subnormals, signed zeros, max finite, inf and nan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from collage.mcf import (
    combine,
    debug_checks,
    checks_enabled,
    eft,
    fast_two_sum,
    grow,
    mul,
    round_to,
    split,
    two_prod,
    two_sum,
    ulp,
)
from collage.mcf.blocks import block_scales
from collage.mcf.formats import format_info
from collage.optim.rounding import stochastic_round

from . import exact as X
from .exact import F64, one_torch_thread  # noqa: F401 (autouse fixture)

DTYPE_PARAMS = [pytest.param(d, id=X.dtype_id(d)) for d in X.DTYPES]

# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _sign(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.where(torch.rand(n, generator=gen) < 0.5, -1, 1)


def gap_pairs(dtype, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` 0..60 binades below ``a`` (clipped to the format), random mantissas; half swapped."""
    fmt = X.FORMATS[dtype]
    lowest = fmt.emin - fmt.p + 1  # exponent of the smallest subnormal
    ea = torch.randint(lowest, fmt.emax + 1, (n,), generator=gen)
    gap = torch.randint(0, min(60, fmt.emax - lowest) + 1, (n,), generator=gen)
    top = 1 << (fmt.p - 1)
    ma = top + torch.randint(0, top, (n,), generator=gen)
    mb = torch.randint(0, 2 * top, (n,), generator=gen)
    a = X.values_from_parts(_sign(n, gen), ma, ea - (fmt.p - 1), dtype)
    b = X.values_from_parts(_sign(n, gen), mb, ea - gap - (fmt.p - 1), dtype)
    swap = torch.rand(n, generator=gen) < 0.5
    return torch.where(swap, b, a), torch.where(swap, a, b)


def tie_pairs(dtype, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``a + b`` exactly halfway between two neighbours of ``a`` (b = odd * ulp(a) / 2)."""
    fmt = X.FORMATS[dtype]
    ea = torch.randint(fmt.emin, fmt.emax + 1, (n,), generator=gen)
    ma = (1 << (fmt.p - 1)) + torch.randint(0, 1 << (fmt.p - 1), (n,), generator=gen)
    odd = 2 * torch.randint(0, 3, (n,), generator=gen) + 1
    a = X.values_from_parts(_sign(n, gen), ma, ea - (fmt.p - 1), dtype)
    b = X.values_from_parts(_sign(n, gen), odd, ea - fmt.p, dtype)
    return a, b


def cancel_pairs(dtype, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``b = -(a + j ulp(a))`` for j in -3..3: heavy or total cancellation."""
    fmt = X.FORMATS[dtype]
    ea = torch.randint(fmt.emin - fmt.p + 1, fmt.emax + 1, (n,), generator=gen)
    ma = torch.randint(0, 1 << fmt.p, (n,), generator=gen)
    j = torch.randint(-3, 4, (n,), generator=gen)
    mb = torch.clamp(ma + j, 0, (1 << fmt.p) - 1)
    s = _sign(n, gen)
    return X.values_from_parts(s, ma, ea - (fmt.p - 1), dtype), X.values_from_parts(
        -s, mb, ea - (fmt.p - 1), dtype
    )


def adversarial_pairs(dtype, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    sv = X.special_values(dtype, every=1 if X.FORMATS[dtype].width == 8 else 8)
    sa, sb = sv.repeat_interleave(sv.numel()), sv.repeat(sv.numel())  # every special x special
    parts = [
        gap_pairs(dtype, n, gen),
        tie_pairs(dtype, n, gen),
        cancel_pairs(dtype, n, gen),
        (sa, sb),
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def b_values(dtype, gen: torch.Generator) -> torch.Tensor:
    """~175-200 structured + random partners for an exhaustive sweep over a 16-bit ``a``."""
    fmt = X.FORMATS[dtype]
    lowest = fmt.emin - fmt.p + 1
    sub = fmt.smallest_subnormal
    ulp_max = 2.0 ** (fmt.emax - fmt.p + 1)
    named = [
        0.0,
        sub,
        fmt.smallest_normal - sub,
        fmt.smallest_normal,
        1.0,
        1 + 2.0 ** (1 - fmt.p),
        1 - 2.0**-fmt.p,
        1.5,
        fmt.max_finite,
        fmt.max_finite - ulp_max,
    ]
    step = max(1, (fmt.emax - lowest) // 40)
    named += [2.0**k for k in range(lowest, fmt.emax + 1, step)]
    named += [(2 - 2.0 ** (1 - fmt.p)) * 2.0**k for k in range(fmt.emin, fmt.emax, 2 * step)]
    mags = torch.tensor(sorted(set(named)), dtype=F64)
    structured = torch.cat([mags, -mags]).to(dtype)
    assert torch.equal(structured.to(F64), torch.cat([mags, -mags]))
    nonfinite = torch.tensor(
        [math.nan] + ([math.inf, -math.inf] if fmt.has_inf else []), dtype=F64
    ).to(dtype)
    return torch.cat([structured, nonfinite, X.random_values(dtype, 48, gen, finite=False)])


def binary_inputs(dtype, seed: int, chunk: int = 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The input batches for a binary primitive (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = X.FORMATS[dtype]
    if fmt.width == 8:
        v = X.all_values(dtype)
        yield v.repeat_interleave(256), v.repeat(256)  # all 65536 pairs
    elif fmt.width == 16:
        a = X.all_values(dtype)
        bs = b_values(dtype, gen)
        for i in range(0, bs.numel(), chunk):
            b = bs[i : i + chunk]
            yield a.repeat(b.numel()), b.repeat_interleave(a.numel())
    else:
        for _ in range(2):
            yield X.random_values(dtype, 500_000, gen, finite=False), X.random_values(
                dtype, 500_000, gen, finite=False
            )
    yield adversarial_pairs(dtype, 30_000 if fmt.width == 32 else 5_000, gen)


def normalised_lo(hi: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tail with ``|lo| <= ulp(hi)/2``: 1/4 the extreme +-ulp(hi)/2, 1/8 zero, the rest
    random at random scales. RN of a value <= the power of two ulp(hi)/2 stays <= it."""
    n = hi.numel()
    half = X.ulp(hi.to(F64), hi.dtype) / 2
    r = (2 * torch.rand(n, generator=gen, dtype=F64) - 1) * X.pow2(
        -torch.randint(0, 12, (n,), generator=gen)
    )
    pick = torch.rand(n, generator=gen)
    r = torch.where(
        pick < 0.125, 1.0, torch.where(pick < 0.25, -1.0, torch.where(pick < 0.375, 0.0, r))
    )
    lo = X.round_exact(torch.where(X.isfinite(half), half * r, 0.0), hi.dtype)
    return lo.to(hi.dtype)


# --------------------------------------------------------------------------------------------
# Checks shared by two_sum and fast_two_sum
# --------------------------------------------------------------------------------------------


def check_exact_sum(
    name: str, a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, e: torch.Tensor
) -> None:
    """s == RN(a + b) bitwise; where s is finite, e == a + b - s (so s + e == a + b exactly,
    compared as canonical pairs) and |e| <= ulp(s)/2; elsewhere e == +0."""
    assert s.dtype == e.dtype == a.dtype
    sa, ea = X.exact_sum(a, b)
    s_ref, e_ref = X.ref_two_sum(a, b, exact=(sa, ea))
    X.assert_same(s, s_ref, f"{name}: s == RN(a + b)", a, b)
    fin = X.isfinite(s_ref)
    e64 = e.to(F64)
    X.assert_same(
        torch.where(fin, e64, X.bits_of(e).to(F64)),
        torch.where(fin, e_ref, 0.0),
        f"{name}: e == a + b - s (+0 where s is not finite)",
        a,
        b,
        signed_zero=False,
    )
    # s + e == a + b exactly, as canonical float64 pairs (non-finite rows compare 0 + 0 == 0 + 0)
    zero = torch.zeros_like(e64)
    same = X.pair_equal(
        torch.where(fin, s.to(F64), zero),
        torch.where(fin, e64, zero),
        torch.where(fin, sa, zero),
        torch.where(fin, ea, zero),
        canonical=True,
    )
    assert bool(same.all()), f"{name}: s + e != a + b"
    # |e| <= ulp(s) / 2
    assert bool(((e64.abs() <= X.ulp(s_ref, a.dtype) / 2) | ~fin).all()), f"{name}: |e| > ulp(s)/2"


# --------------------------------------------------------------------------------------------
# the elementary operations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_each_elementary_operation_is_the_exact_result_rounded_once(dtype):
    """``_add``, ``_sub`` and ``_mul``, of which every primitive is made, are the exact sum,
    difference and product rounded once to the component dtype (bitwise: signed zeros,
    overflow, inf and nan included). bfloat16 and float16 compute them in float32 and round
    again; the inputs here are every ``a`` against ~200 ``b`` and the adversarial pairs, and
    every pair was checked offline (formats.py's docstring)."""
    assert format_info(dtype).working_dtype == (
        torch.float32 if dtype in (torch.bfloat16, torch.float16) else F64)
    for a, b in binary_inputs(dtype, seed=23):
        minus_b = b.to(F64).neg().to(dtype)  # exact: a negated component is a component
        for name, got, want in (
                ("_add", eft._add(a, b), X.round_pair(*X.exact_sum(a, b), dtype)),
                ("_sub", eft._sub(a, b), X.round_pair(*X.exact_sum(a, minus_b), dtype)),
                ("_mul", eft._mul(a, b), X.round_exact(X.exact_product(a, b), dtype))):
            assert got.dtype == dtype
            X.assert_same(got, want, f"{name}: the exact result rounded once", a, b)


# --------------------------------------------------------------------------------------------
# two_sum
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_two_sum_is_exact(dtype):
    for a, b in binary_inputs(dtype, seed=21):
        s, e = two_sum(a, b)
        check_exact_sum("two_sum", a, b, s, e)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_two_sum_signed_zeros(dtype):
    """IEEE 754 6.3: an exact zero sum is +0 under round-to-nearest unless both operands are -0."""
    z, nz, one, mone = (torch.tensor([v], dtype=F64).to(dtype) for v in (0.0, -0.0, 1.0, -1.0))
    for a, b, negative in [
        (nz, nz, True),
        (z, nz, False),
        (nz, z, False),
        (z, z, False),
        (one, mone, False),
        (mone, one, False),
    ]:
        s, e = two_sum(a, b)
        assert X.bits_of(s).item() == (1 << (X.FORMATS[dtype].width - 1) if negative else 0), (
            a,
            b,
            s,
        )
        assert e.item() == 0


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_two_sum_nonfinite_rule(dtype):
    fmt = X.FORMATS[dtype]
    big = torch.tensor([fmt.max_finite], dtype=F64).to(dtype)
    nan = torch.tensor([math.nan], dtype=F64).to(dtype)
    s, e = two_sum(big, big)  # overflow: inf, or nan for e4m3fn
    assert (s.to(F64).item() == math.inf) if fmt.has_inf else math.isnan(s.to(F64).item())
    X.assert_positive_zero(e, "overflow")
    s, e = two_sum(nan, big)
    assert math.isnan(s.to(F64).item())
    X.assert_positive_zero(e, "nan")
    if fmt.has_inf:
        inf, minf = (torch.tensor([v], dtype=F64).to(dtype) for v in (math.inf, -math.inf))
        s, e = two_sum(inf, minf)
        assert math.isnan(s.to(F64).item())
        X.assert_positive_zero(e, "inf - inf")
        s, e = two_sum(minf, big)
        assert s.to(F64).item() == -math.inf
        X.assert_positive_zero(e, "-inf + max")


# --------------------------------------------------------------------------------------------
# fast_two_sum
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_fast_two_sum_is_exact_under_its_precondition(dtype):
    checked = 0
    for i, (a, b) in enumerate(binary_inputs(dtype, seed=22)):
        if X.FORMATS[dtype].width == 16 and i % 2:
            continue  # half of the 16-bit sweep: fast_two_sum shares its code path with two_sum
        a64, b64 = a.to(F64), b.to(F64)
        ok = (a64.abs() >= b64.abs()) | (a64 == 0)
        a, b = a[ok], b[ok]
        s, e = fast_two_sum(a, b)
        check_exact_sum("fast_two_sum", a, b, s, e)
        checked += a.numel()
    assert checked > 10_000


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_fast_two_sum_debug_checks(dtype):
    t = lambda *v: torch.tensor(v, dtype=F64).to(dtype)  # noqa: E731
    small, large = t(1.0, 2.0), t(3.0, -4.0)
    assert not checks_enabled()
    fast_two_sum(small, large)  # unchecked by default: no error (result unspecified)
    with debug_checks():
        assert checks_enabled()
        with pytest.raises(ValueError, match="2 element"):
            fast_two_sum(small, large)
        fast_two_sum(large, small)  # precondition holds
        fast_two_sum(t(0.0, 0.0), large)  # a == 0 is allowed
        fast_two_sum(t(math.nan, 1.0), t(2.0, math.nan))  # non-finite: not checked
        with debug_checks(False):
            fast_two_sum(small, large)
    assert not checks_enabled()
    with pytest.raises(ValueError):
        with debug_checks():
            fast_two_sum(small, large)
    assert not checks_enabled()  # restored after the exception


# --------------------------------------------------------------------------------------------
# two_prod
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_two_prod(dtype):
    """p == RN(a*b) always; e == RN(a*b - p) always; and e == a*b - p exactly (so p + e == a*b)
    whenever the product does not underflow, i.e. a or b is 0 or ea + eb >= emin + p - 1
    (``exact.no_product_underflow``)."""
    underflowed = exact_seen = 0
    for a, b in binary_inputs(dtype, seed=23):
        p, e = two_prod(a, b)
        assert p.dtype == e.dtype == dtype
        p_ref, e_ref, prod = X.ref_two_prod(a, b)
        X.assert_same(p, p_ref, "two_prod: p == RN(a*b)", a, b)
        fin = X.isfinite(p_ref)
        X.assert_same(
            torch.where(fin, e.to(F64), X.bits_of(e).to(F64)),
            e_ref,
            "two_prod: e == RN(a*b - p) (+0 where p is not finite)",
            a,
            b,
            signed_zero=False,
        )
        # the condition is sufficient: there, RN(a*b - p) == a*b - p, so p + e == a*b exactly
        nu = fin & X.no_product_underflow(a, b)
        zero = torch.zeros_like(prod)
        pf = torch.where(nu, p_ref, zero)
        diff = torch.where(nu, prod, zero) - pf  # exact (Sterbenz, or p == 0)
        assert bool(((e_ref == diff) | ~nu).all()), "no_product_underflow is not sufficient"
        same = X.pair_equal(
            pf, torch.where(nu, e.to(F64), zero), torch.where(nu, prod, zero), zero, canonical=True
        )
        assert bool(same.all()), "p + e != a*b"
        exact_seen += int(nu.sum())
        underflowed += int((fin & (e_ref != prod - torch.where(fin, p_ref, zero))).sum())
    assert exact_seen > 10_000
    assert underflowed > 0, "the sample must include products whose error underflows"


# --------------------------------------------------------------------------------------------
# grow
# --------------------------------------------------------------------------------------------


def grow_inputs(dtype, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Normalised (hi, lo) and any x: float8 over all 256 x 256 (hi, x) pairs with three tails
    each (mostly the extremes +-ulp(hi)/2, zero, or random); 16-bit formats over every finite
    hi against 32 x values; float32 random; plus adversarial (hi, x) pairs for all."""
    gen = torch.Generator().manual_seed(seed)
    fmt = X.FORMATS[dtype]
    if fmt.width == 8:
        hi, x = next(binary_inputs(dtype, seed))
        hi = torch.where(X.isfinite(hi.to(F64)), hi, torch.zeros_like(hi))
        for _ in range(3):
            yield hi, normalised_lo(hi, gen), x
    elif fmt.width == 16:
        hi = X.all_values(dtype)
        hi = hi[X.isfinite(hi.to(F64))]
        xs = b_values(dtype, gen)
        xs = xs[torch.randperm(xs.numel(), generator=gen)[:32]]
        for i in range(0, 32, 16):
            h = hi.repeat(16)
            yield h, normalised_lo(h, gen), xs[i : i + 16].repeat_interleave(hi.numel())
    else:
        h = X.random_values(dtype, 200_000, gen)
        yield h, normalised_lo(h, gen), X.random_values(dtype, 200_000, gen, finite=False)
    a, b = adversarial_pairs(dtype, 10_000, gen)
    for h, x in ((a, b), (b, a)):
        fin = X.isfinite(h.to(F64))
        yield h[fin], normalised_lo(h[fin], gen), x[fin]


def abs_at_most(lhs: list[torch.Tensor], rhs: list[torch.Tensor]) -> torch.Tensor:
    """Exactly: |sum(lhs)| <= sum(rhs) (rhs a sum of non-negative terms)."""
    neg = [-t for t in lhs]
    return (X.sum_sign(rhs + neg) >= 0) & (X.sum_sign(rhs + lhs) >= 0)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_grow(dtype):
    """grow(hi, lo, x) for a normalised pair (|lo| <= ulp(hi)/2):

    1. It is exactly ``two_sum(s, t)`` with ``(s, e) = two_sum(hi, x)`` exact and
       ``t = RN(lo + e)`` its only rounding (each step from the exact reference); in
       particular ``hi' + lo' == s + t`` exactly.
    2. The result is normalised: ``|lo'| <= ulp(hi')/2``.
    3. One-call bound. By 1, ``hi' + lo' = hi + lo + x - d`` with ``d = lo + e - t`` the
       rounding error of t, so ``|d| <= u |lo + e|`` (0 when lo + e is subnormal: such sums are
       exact) and, since ``|lo| <= ulp(hi)/2`` and ``|e| <= ulp(s)/2``,

           |d| <= (u/2) (ulp(hi) + ulp(s))                            (checked for all inputs)

       For |x| <= |hi|: |s| <= 2|hi| so ulp(s) <= 2 ulp(hi), and ulp(hi) <= 2u|hi| for normal hi:

           |d| <= 1.5 u ulp(hi) <= 3 u**2 |hi|                         (checked where it applies)

       d is the rounding error of a sum of two component values, hence a component value
       itself, so it and the bounds (sums of two powers of two) compare exactly in float64.
    """
    fmt = X.FORMATS[dtype]
    u = fmt.u
    bounded = 0
    for hi, lo, x in grow_inputs(dtype, seed=24):
        assert bool((lo.to(F64).abs() <= X.ulp(hi.to(F64), dtype) / 2).all())  # inputs normalised
        h2, l2 = grow(hi, lo, x)
        assert h2.dtype == l2.dtype == dtype
        # 1. the exact chain, and 2. normalised
        s, t, tail_hi, tail_lo, fin = check_grow_chain(hi, lo, x, h2, l2)
        # 3. the bound
        head, rest = X.two_sum64(
            tail_hi[fin] - t[fin], tail_lo[fin]
        )  # d; tail_hi - t is exact (Sterbenz)
        assert bool((rest == 0).all())
        d = head.abs()
        H, S = hi[fin].to(F64), s[fin]
        good = d <= u / 2 * (X.ulp(H, dtype) + X.ulp(S, dtype))
        assert bool(good.all()), f"grow: bound violated at hi={H[~good][:3]}, x={x[fin][~good][:3]}"
        small = (x[fin].to(F64).abs() <= H.abs()) & (H.abs() >= fmt.smallest_normal)
        good = (d[small] <= 1.5 * u * X.ulp(H[small], dtype)) & (
            d[small] <= 3 * u * u * H[small].abs()
        )
        assert bool(good.all()), "grow: 1.5 u ulp(hi) / 3u^2|hi| bound violated"
        bounded += int(small.sum())
    assert bounded > 10_000


def past_overflow_reference(hi, lo, x):
    """Where s = RN(hi + x) is not finite and hi, lo, x are: (mask, RN(S), RN(S - RN(S)))
    for the exact sum S = hi + lo + x (hi + x is exact in float64 there: both within
    2**26 of the largest value; + lo kept as an exact float64 pair)."""
    dtype = hi.dtype
    s, _ = X.ref_two_sum(hi, x)
    past = X.isfinite(hi) & X.isfinite(lo) & X.isfinite(x) & ~X.isfinite(s)
    sum_hi, sum_lo = X.two_sum64(torch.where(past, hi.to(F64) + x.to(F64), 0.0),
                                 torch.where(past, lo.to(F64), 0.0))
    head = X.round_pair(sum_hi, sum_lo, dtype)
    rest_hi, rest_lo = X.two_sum64(torch.where(X.isfinite(head), sum_hi - head, 0.0), sum_lo)
    return past, head, X.round_pair(rest_hi, rest_lo, dtype)


def check_grow_chain(hi, lo, x, h2, l2):
    """grow == two_sum(s, RN(lo + e)) with (s, e) = two_sum(hi, x), every step exact, where
    s is finite; where s overflows and the inputs are finite, grow == (RN(S), RN(S - RN(S)))
    for the exact sum S; the result is normalised. Returns (s, t, tail_hi, tail_lo, mask
    of the finite lanes of the chain)."""
    dtype = hi.dtype
    s, e = X.ref_two_sum(hi, x)
    tail_hi, tail_lo = X.two_sum64(lo.to(F64), e)  # lo + e, exactly
    t = X.round_pair(tail_hi, tail_lo, dtype)
    h_ref, l_ref = X.ref_two_sum(s.to(dtype), t.to(dtype))  # exact conversions: both representable
    past, past_hi, past_lo = past_overflow_reference(hi, lo, x)
    h_ref = torch.where(past, past_hi, h_ref)
    l_ref = torch.where(past, torch.where(X.isfinite(past_hi), past_lo, 0.0), l_ref)
    X.assert_same(h2, h_ref, "grow: hi'", hi, lo, x)
    fin = X.isfinite(h_ref)
    X.assert_same(
        torch.where(fin, l2.to(F64), X.bits_of(l2).to(F64)),
        l_ref,
        "grow: lo' (+0 where hi' is not finite)",
        hi,
        lo,
        x,
        signed_zero=False,
    )
    zero = torch.zeros_like(t)
    chain = fin & ~past
    same = X.pair_equal(
        torch.where(chain, h2.to(F64), zero),
        torch.where(chain, l2.to(F64), zero),
        torch.where(chain, s, zero),
        torch.where(chain, t, zero),
    )
    assert bool(same.all()), "grow: hi' + lo' != s + t"
    assert bool(
        ((l2.to(F64).abs() <= X.ulp(h_ref, dtype) / 2) | ~fin).all()
    ), "grow: result not normalised"
    return s, t, tail_hi, tail_lo, chain


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_grow_renormalises_any_pair(dtype):
    """The final two_sum makes grow exact-plus-one-rounding and normalising even when the
    input pair is not normalised (any lo). (For normalised inputs |s| >= |t| always holds, so
    there Fast2Sum would do; these inputs are where it would not.)"""
    gen = torch.Generator().manual_seed(25)
    fmt = X.FORMATS[dtype]
    if fmt.width == 8:
        hi, lo = next(binary_inputs(dtype, 25))  # every (hi, lo) pair
        x = X.random_values(dtype, hi.numel(), gen, finite=False)
    else:
        hi, lo, x = (X.random_values(dtype, 200_000, gen, finite=False) for _ in range(3))
    keep = X.isfinite(hi) & X.isfinite(lo)
    hi, lo, x = hi[keep], lo[keep], x[keep]
    h2, l2 = grow(hi, lo, x)
    s, t, *_ = check_grow_chain(hi, lo, x, h2, l2)
    fin = X.isfinite(s)
    assert bool((fin & (s.abs() < t.abs())).any()), "the sample must include |s| < |t|"


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_grow_nonfinite_rule(dtype):
    fmt = X.FORMATS[dtype]
    t = lambda *v: torch.tensor(v, dtype=F64).to(dtype)  # noqa: E731
    big = fmt.max_finite
    hi, lo, x = t(big, 1.0, math.nan, 0.0), t(0.0, 0.0, 0.0, 0.0), t(big, math.nan, 1.0, math.nan)
    h2, l2 = grow(hi, lo, x)
    want = t(math.inf if fmt.has_inf else math.nan, math.nan, math.nan, math.nan).to(F64)
    X.assert_same(h2, want, "grow non-finite", hi, x)
    X.assert_positive_zero(l2, "grow non-finite lo'")
    if fmt.has_inf:
        h2, l2 = grow(t(math.inf, -math.inf, 1.0), t(0.0, 0.0, 0.5), t(1.0, math.inf, -math.inf))
        X.assert_same(h2, torch.tensor([math.inf, math.nan, -math.inf], dtype=F64), "grow with inf")
        X.assert_positive_zero(l2, "grow with inf lo'")


def test_grow_accumulation_tracks_float64_sum():
    """10,000 small updates (|x| in [1e-4, 1e-3], random signs, 80% positive so the sum drifts
    as a weight does in training) to a bfloat16 pair starting at 1.0, for 16 seeded streams.

    Reference: the float64 sum, which is exact here (checked): every update is a multiple of
    2**-21 and 1 + sum|x| < 2**6, so every partial sum, in any order, fits in 27 bits.

    Rigorous bound: each grow call errs by |d| <= (u/2)(ulp(hi) + ulp(s)) (test_grow). While
    |hi| and |s| stay below 8 (checked), ulp(.) <= 2**-5, so |d| <= u * 2**-5 = 2**-13 and
    after N calls |pair - sum| <= N * 2**-13 ~= 1.22. Plain bfloat16 loses every update (each
    is below half an ulp of 1.0), so it ends ~3 away from the sum.
    """
    bf = torch.bfloat16
    n_steps, streams = 10_000, 16
    gen = torch.Generator().manual_seed(31)
    mags = 1e-4 + 9e-4 * torch.rand(n_steps, streams, generator=gen, dtype=F64)
    signs = torch.where(torch.rand(n_steps, streams, generator=gen) < 0.8, 1.0, -1.0)
    updates = (signs * mags).to(bf)
    hi, lo = torch.ones(streams, dtype=bf), torch.zeros(streams, dtype=bf)
    plain = torch.ones(streams, dtype=bf)
    largest = torch.zeros(streams, dtype=F64)
    for k in range(n_steps):
        x = updates[k]
        hi, lo = grow(hi, lo, x)
        plain = plain + x  # torch's bf16 add: exact float32 sum, rounded once to bf16
        largest = torch.maximum(largest, hi.to(F64).abs())
    # |hi| <= 7.9 and |x| < 1e-3 keep every s = RN(hi + x) below 8 as well
    assert bool((largest <= 7.9).all())
    # the float64 sum is exact in any order: multiples of 2**-21 with 1 + sum|x| < 2**6
    u64 = updates.to(F64)
    assert torch.equal(u64 * 2.0**21, torch.round(u64 * 2.0**21))
    assert bool((1 + u64.abs().sum(dim=0) < 2.0**6).all())
    exact = 1.0 + u64.sum(dim=0)
    bound = n_steps * 2.0**-13
    pair_err = X.sum_approx([hi, lo, -exact]).abs()
    plain_err = (
        plain.to(F64) - exact
    ).abs()  # exact: both operands are multiples of 2**-21 below 2**6
    print(
        f"\nbf16 grow accumulation over {n_steps} updates ({streams} streams): "
        f"max |pair - float64| = {pair_err.max().item():.3e}, "
        f"min |plain bf16 - float64| = {plain_err.min().item():.3e}, "
        f"rigorous pair bound = {bound:.3e}"
    )
    # exact comparisons: |hi + lo - sum| <= bound < |plain - sum|
    bound_t = torch.full_like(exact, bound)
    assert bool(abs_at_most([hi.to(F64), lo.to(F64), -exact], [bound_t]).all())
    assert bool((plain_err > bound).all())


# --------------------------------------------------------------------------------------------
# mul
# --------------------------------------------------------------------------------------------


def mul_inputs(dtype, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Normalised pairs. Heads: random bit patterns (any binade), random significands in the
    binades whose products neither under- nor overflow, and all-ones significands (largest
    rounding errors). Tails: random, zero, or the extremes +-ulp(head)/2."""
    fmt = X.FORMATS[dtype]
    lo_e, hi_e = -((-(fmt.emin + 2 * fmt.p + 2)) // 2), (fmt.emax - 1) // 2
    heads = []
    for _ in range(2):
        k = torch.randint(lo_e, hi_e + 1, (n,), generator=gen)
        mid = X.values_from_parts(
            _sign(n, gen),
            torch.randint(1 << (fmt.p - 1), 1 << fmt.p, (n,), generator=gen),
            k - fmt.p + 1,
            dtype,
        )
        k = torch.randint(lo_e, hi_e + 1, (n // 4,), generator=gen)
        ones = X.values_from_parts(
            _sign(n // 4, gen), torch.full((n // 4,), (1 << fmt.p) - 1), k - fmt.p + 1, dtype
        )
        heads.append(torch.cat([X.random_values(dtype, n // 2, gen), mid, ones]))
    hi, b_hi = heads
    return hi, normalised_lo(hi, gen), b_hi, normalised_lo(b_hi, gen)


def ref_mul(hi, lo, b_hi, b_lo):
    """DWTimesDW1 as documented, every operation rounded by the exact reference; plus the
    non-finite rule (z_hi is IEEE's RN(hi * b_hi) wherever that is not finite)."""
    dtype = hi.dtype
    rn = lambda v: X.round_exact(v, dtype)  # noqa: E731
    c_hi, c_lo1, _ = X.ref_two_prod(hi, b_hi)
    m1 = rn(X.exact_product(hi, b_lo))
    m2 = rn(X.exact_product(lo, b_hi))
    c_lo2 = X.round_pair(*X.two_sum64(m1, m2), dtype)
    c_lo3 = X.round_pair(*X.two_sum64(c_lo1, c_lo2), dtype)
    fin = X.isfinite(c_hi) & X.isfinite(c_lo3)
    # Fast2Sum's precondition holds (checked), so it returns the exact two_sum result
    assert bool((c_hi[fin].abs() >= c_lo3[fin].abs()).all()), "DWTimesDW1: |c_hi| < |c_lo3|"
    z_hi, z_lo = X.ref_two_sum(c_hi.to(dtype), c_lo3.to(dtype))
    z_hi = torch.where(X.isfinite(c_hi), z_hi, c_hi)
    return z_hi, torch.where(X.isfinite(z_hi), z_lo, 0.0)


def check_mul(hi, lo, b_hi, b_lo) -> tuple[int, float]:
    """Checks 1 and 2 of test_mul on one batch; returns (inputs checked against the bound,
    largest relative error seen in units of u**2)."""
    dtype = hi.dtype
    fmt = X.FORMATS[dtype]
    z_hi, z_lo = mul(hi, lo, b_hi, b_lo)
    assert z_hi.dtype == z_lo.dtype == dtype
    r_hi, r_lo = ref_mul(hi, lo, b_hi, b_lo)
    X.assert_same(z_hi, r_hi, "mul: z_hi", hi, lo, b_hi, b_lo)
    fin = X.isfinite(r_hi)
    X.assert_same(
        torch.where(fin, z_lo.to(F64), X.bits_of(z_lo).to(F64)),
        r_lo,
        "mul: z_lo (+0 where z_hi is not finite)",
        hi,
        lo,
        b_hi,
        b_lo,
        signed_zero=False,
    )

    prods = [
        X.exact_product(hi, b_hi),
        X.exact_product(hi, b_lo),
        X.exact_product(lo, b_hi),
        X.exact_product(lo, b_lo),
    ]
    tiny = lambda v: (v != 0) & (v.abs() < fmt.smallest_normal)  # noqa: E731
    ok = (
        fin & ~tiny(prods[0]) & ~tiny(prods[1]) & ~tiny(prods[2]) & X.no_product_underflow(hi, b_hi)
    )
    ok &= prods[0].abs() <= fmt.max_finite / 2
    P = [v[ok] for v in prods]
    Z = [z_hi[ok].to(F64), z_lo[ok].to(F64)]
    sigma = X.sum_sign(P)
    scale = 2.0 ** (2 * fmt.p)  # u**-2
    lhs = [scale * v for v in Z] + [-scale * v for v in P]  # u**-2 * (Z - P)
    rhs = [sigma * 8.0 * v for v in P] + [-sigma * v for v in P]  # 7 |P| = sigma * (8P - P)
    good = abs_at_most(lhs, rhs)
    approx_p = X.sum_approx(P)
    rel = (
        X.sum_approx(Z + [-v for v in P]) / torch.where(approx_p == 0, 1.0, approx_p)
    ).abs() / fmt.u**2
    if not bool(good.all()):
        idx = (~good).nonzero().reshape(-1)[:5]
        cases = [
            tuple(v[ok][i].to(F64).item() for v in (hi, lo, b_hi, b_lo)) + (rel[i].item(),)
            for i in idx.tolist()
        ]
        raise AssertionError(
            f"mul: relative error > 7u^2 in {int((~good).sum())} cases, "
            f"e.g. (hi, lo, b_hi, b_lo, err/u^2): {cases}"
        )
    return int(ok.sum()), float(rel.max()) if rel.numel() else 0.0


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_mul(dtype):
    """1. mul equals DWTimesDW1 computed with exactly rounded operations.
    2. Relative error <= 7 u**2 (Joldes, Muller & Popescu 2017) for normalised inputs without
       underflow: every partial product hi*b_hi, hi*b_lo, lo*b_hi is 0 or >= 2**emin in
       magnitude, the error of hi*b_hi is representable, and nothing overflows. Checked
       exactly (exact.sum_sign), on random normalised pairs and, for float8, on every pair of
       heads with tails in {0, +-ulp/4, +-ulp/2} (the extremes give the largest errors)."""
    gen = torch.Generator().manual_seed(41)
    n = 100_000
    checked, worst = check_mul(*mul_inputs(dtype, n, gen))
    assert checked > n // 2, "too few inputs satisfy the theorem's conditions"
    if X.FORMATS[dtype].width == 8:
        v = X.all_values(dtype)
        v = v[X.isfinite(v)]
        hi, b_hi = v.repeat_interleave(v.numel()), v.repeat(v.numel())
        half_a, half_b = X.ulp(hi, dtype) / 2, X.ulp(b_hi, dtype) / 2
        for fa in (-1.0, -0.5, 0.0, 0.5, 1.0):
            for fb in (-1.0, 0.0, 0.5, 1.0):
                lo = X.round_exact(half_a * fa, dtype).to(dtype)
                b_lo = X.round_exact(half_b * fb, dtype).to(dtype)
                c, w = check_mul(hi, lo, b_hi, b_lo)
                checked, worst = checked + c, max(worst, w)
    print(
        f"\nmul {X.dtype_id(dtype)}: {checked} inputs checked, "
        f"max relative error ~= {worst:.3f} u^2 (bound 7)"
    )


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_mul_nonfinite_rule(dtype):
    """The leading component is IEEE's result for the leading product; the tail is +0."""
    fmt = X.FORMATS[dtype]
    t = lambda *v: torch.tensor(v, dtype=F64).to(dtype)  # noqa: E731
    big = fmt.max_finite
    zeros = t(0.0, 0.0, 0.0, 0.0)
    hi, b_hi = t(big, math.nan, 0.0, 2.0), t(big, 1.0, math.nan, -big)
    z_hi, z_lo = mul(hi, zeros, b_hi, zeros)
    over = math.inf if fmt.has_inf else math.nan
    X.assert_same(
        z_hi, torch.tensor([over, math.nan, math.nan, -over], dtype=F64), "mul overflow/nan"
    )
    X.assert_positive_zero(z_lo, "mul non-finite tail")
    if fmt.has_inf:
        inf = math.inf
        hi, b_hi = t(inf, inf, -inf, 0.0, 2.0), t(2.0, -inf, 0.5, inf, inf)
        z_hi, z_lo = mul(hi, t(0, 0, 0, 0, 0), b_hi, t(0, 0, 0, 0, 0))
        X.assert_same(
            z_hi, torch.tensor([inf, -inf, -inf, math.nan, inf], dtype=F64), "mul with inf"
        )
        X.assert_positive_zero(z_lo, "mul with inf tail")


# --------------------------------------------------------------------------------------------
# split and combine
# --------------------------------------------------------------------------------------------


def float32_split_probes(gen: torch.Generator) -> torch.Tensor:
    """Normal float32 with 2**-110 <= |x| < bf16's overflow threshold: random bit patterns, and
    for every exponent in range, significands that stress the bf16 boundaries (all ones,
    alternating, ties at bit 8 and bit 16, single low bits)."""
    x = X.random_values(torch.float32, 600_000, gen).to(F64)
    patterns = [
        0x7FFFFF,
        0x555555,
        0x2AAAAA,
        0x008000,
        0x018000,
        0x7F8000,
        0x000080,
        0x000180,
        0x008080,
        0x7F7F7F,
        0x000001,
        0x400001,
        0x7FFF00,
        0x00FFFF,
        0x000000,
    ]
    exps = torch.arange(-110, 128)
    m = torch.tensor(patterns).repeat(exps.numel()) + (1 << 23)
    k = exps.repeat_interleave(len(patterns))
    structured = m.to(F64) * X.pow2(k - 23)
    rnd = (torch.randint(0, 1 << 23, (exps.numel() * 64,), generator=gen) + (1 << 23)).to(
        F64
    ) * X.pow2(exps.repeat(64) - 23)
    x = torch.cat([x, structured, -structured, rnd, -rnd])
    threshold = (2 - 2.0**-8) * 2.0**127  # bf16's overflow threshold (ties go to even = 2**128)
    keep = (x.abs() >= 2.0**-110) & (x.abs() < threshold)
    return x[keep].to(torch.float32)


def check_nonoverlapping(components, dtype, what):
    for c, d in zip(components, components[1:]):
        fin = X.isfinite(c.to(F64))
        ok = d[fin].to(F64).abs() <= X.ulp(c[fin].to(F64), dtype) / 2
        assert bool(ok.all()), f"{what}: components overlap"


def test_split_float32_into_three_bfloat16_is_exact():
    """Three bf16 components hold every normal float32 with 2**-110 <= |x| < bf16's overflow
    threshold: x's last bit is >= 2**-133 (bf16's smallest subnormal), r1 = x - c0 has at
    most 15 significant bits, r2 = r1 - c1 at most 7, so c2 = r2 exactly."""
    bf = torch.bfloat16
    x = float32_split_probes(torch.Generator().manual_seed(51))
    c = split(x, bf, 3)
    assert len(c) == 3 and all(t.dtype == bf for t in c)
    x64 = x.to(F64)
    assert bool(
        (X.sum_sign([c[0].to(F64), c[1].to(F64), c[2].to(F64), -x64]) == 0).all()
    ), "split(x, bf16, 3) inexact"
    X.assert_same(combine(*c), x64, "combine(split(x)) == x", x64)
    X.assert_same(combine(*c, dtype=torch.float32), x64, "combine(..., float32) == x", x64)
    check_nonoverlapping(c, bf, "split(float32, bf16, 3)")
    # each component is the correct rounding of the exact remainder
    rem = x64
    for comp in c:
        X.assert_same(comp, X.round_exact(rem, bf), "split component == RN(remainder)", x64)
        rem, lost = X.two_sum64(rem, -comp.to(F64))
        assert bool((lost == 0).all())  # remainders are exact in float64 (Sterbenz)


def test_split_below_2_to_minus_110_counterexample():
    """x = 2**-111 * (1 + 2**-23) is a normal float32 (> 2**-126) whose last bit is 2**-134,
    below bf16's smallest subnormal 2**-133. Every sum of bf16 values is a multiple of 2**-133
    and x is not, so no number of bf16 components can hold it: the documented limit is real.
    Just above the limit, 2**-110 * (1 + 2**-23) splits exactly."""
    bf = torch.bfloat16
    x = torch.tensor([2.0**-111 * (1 + 2.0**-23), 2.0**-110 * (1 + 2.0**-23)], dtype=torch.float32)
    x64 = x.to(F64)
    assert torch.equal(
        x64, torch.tensor([2.0**-111 * (1 + 2.0**-23), 2.0**-110 * (1 + 2.0**-23)], dtype=F64)
    )
    quanta = x64 / 2.0**-133
    assert quanta[0] != torch.floor(quanta[0]) and quanta[1] == torch.floor(quanta[1])
    for n in (3, 5):
        c = split(x, bf, n)
        sign = X.sum_sign([t.to(F64) for t in c] + [-x64])
        assert sign[0].item() != 0, f"split(x, bf16, {n}) cannot be exact below 2**-110"
        assert sign[1].item() == 0
    print(
        f"\nsplit below the limit: x = {x64[0].item()!r}, "
        f"combine(split(x, bf16, 3)) = {combine(*split(x, bf, 3))[0].item()!r}"
    )


def test_split_float32_at_bfloat16_overflow_follows_the_nonfinite_rule():
    """The other end of the exact range: float32 values at or above bf16's overflow threshold
    (2 - 2**-8) * 2**127 (a tie, which goes to the even 2**128) have an infinite leading
    component, and the tails are +0."""
    bf = torch.bfloat16
    below = torch.tensor([(2 - 2.0**-8) * 2.0**127], dtype=F64).to(torch.float32)
    below = torch.nextafter(below, torch.tensor([0.0]))
    x = torch.cat(
        [
            torch.tensor(
                [(2 - 2.0**-8) * 2.0**127, -(2 - 2.0**-23) * 2.0**127], dtype=torch.float32
            ),
            below,
        ]
    )
    c = split(x, bf, 3)
    X.assert_same(c[0][:2], torch.tensor([math.inf, -math.inf], dtype=F64), "split overflow lead")
    for tail in c[1:]:
        X.assert_positive_zero(tail[:2], "split overflow tails")
    assert (
        X.sum_sign([t[2:].to(F64) for t in c] + [-below.to(F64)]).item() == 0
    )  # just below: exact


def test_split_float32_into_two_bfloat16_within_2_to_minus_16():
    """Two components: |x - c0 - c1| <= 2**-16 |x| as documented (u**2); the derivation in
    docs/mcf.md gives 2**-(2p+1) = 2**-17, checked too."""
    bf = torch.bfloat16
    x = float32_split_probes(torch.Generator().manual_seed(52))
    c0, c1 = split(x, bf, 2)
    x64 = x.to(F64)
    err = [x64, -c0.to(F64), -c1.to(F64)]
    assert bool(abs_at_most(err, [x64.abs() * 2.0**-16]).all())
    assert bool(abs_at_most(err, [x64.abs() * 2.0**-17]).all())
    check_nonoverlapping((c0, c1), bf, "split(float32, bf16, 2)")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_split_float64_generic(dtype, n):
    """Any dtype, any n: component k == RN(exact remainder k), components non-overlapping, and
    |x - sum| <= 2**-(n p + n - 1) |x| <= u**n |x| where no remainder underflows."""
    fmt = X.FORMATS[dtype]
    gen = torch.Generator().manual_seed(53 + n)
    m = 60_000
    mant = 1 + torch.rand(m, generator=gen, dtype=F64)
    x = (
        _sign(m, gen)
        * mant
        * X.pow2(torch.randint(fmt.emin - fmt.p - 2, fmt.emax + 1, (m,), generator=gen))
    )
    x = torch.cat(
        [
            x,
            X.special_values(dtype).to(F64),
            torch.tensor([fmt.max_finite * 1.5, 1e300, -1e300], dtype=F64),
        ]
    )
    c = split(x, dtype, n)
    assert len(c) == n and all(t.dtype == dtype for t in c)
    rem = x
    lead_fin = X.isfinite(X.round_exact(x, dtype))
    underflow = torch.zeros_like(x, dtype=torch.bool)
    for k, comp in enumerate(c):
        want = (
            X.round_exact(rem, dtype)
            if k == 0
            else torch.where(lead_fin, X.round_exact(rem, dtype), 0.0)
        )
        X.assert_same(comp, want, f"split component {k}", x, signed_zero=k == 0)
        underflow |= (rem != 0) & (rem.abs() < fmt.smallest_normal)
        rem, lost = X.two_sum64(rem, -torch.where(lead_fin, comp.to(F64), 0.0))
        assert bool((lost[lead_fin] == 0).all())
    check_nonoverlapping(c, dtype, f"split(float64, {dtype}, {n})")
    ok = lead_fin & ~underflow & X.isfinite(x)
    err = [x[ok]] + [-t[ok].to(F64) for t in c]
    bits = n * fmt.p + n - 1
    assert bool(abs_at_most(err, [x[ok].abs() * 2.0**-bits]).all())
    assert int(ok.sum()) > m // 20
    # non-finite rule: overflow / inf / nan lead, +0 tails
    for comp in c[1:]:
        X.assert_positive_zero(comp[~lead_fin], "split tail of a non-finite lead")


def test_split_rejects_bad_arguments():
    with pytest.raises(TypeError):
        split(torch.ones(2, dtype=torch.int32), torch.bfloat16)
    with pytest.raises(ValueError):
        split(torch.ones(2), torch.bfloat16, 0)
    with pytest.raises(TypeError):
        split(torch.ones(2), torch.float64)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_combine(dtype):
    """combine is exact whenever the sum is representable in float64: expansions of values with
    at most min(3p, 48) significant bits split into 3 (2 for float32) components; a narrower
    target rounds once (compared with the reference)."""
    fmt = X.FORMATS[dtype]
    gen = torch.Generator().manual_seed(61)
    m = 50_000
    nbits = min(3 * fmt.p, 48)
    n = 2 if fmt.p == 24 else 3
    mant = torch.randint(1 << (nbits - 1), 1 << nbits, (m,), generator=gen).to(F64)
    top = torch.randint(fmt.emin + fmt.p * (n - 1), fmt.emax, (m,), generator=gen)
    v = _sign(m, gen) * mant * X.pow2(top - nbits + 1)
    c = split(v, dtype, n)
    # n components of p bits hold n*p-bit values exactly (the argument of the split tests)
    assert bool((X.sum_sign([t.to(F64) for t in c] + [-v]) == 0).all())
    X.assert_same(combine(*c), v, "combine exact")
    for target in X.DTYPES:
        X.assert_same(
            combine(*c, dtype=target), X.round_exact(v, target), f"combine -> {target}", v
        )
    # non-finite leads give the IEEE value
    lead = torch.tensor([math.nan] + ([math.inf, -math.inf] if fmt.has_inf else []), dtype=F64).to(
        dtype
    )
    zero = torch.zeros_like(lead)
    X.assert_same(combine(lead, zero, zero), lead.to(F64), "combine non-finite")
    with pytest.raises(ValueError):
        combine()


# --------------------------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------------------------


def test_mixed_dtypes_are_rejected_with_the_argument_name():
    a, b = torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16)
    for fn in (two_sum, fast_two_sum, two_prod):
        with pytest.raises(TypeError, match="b has dtype"):
            fn(a, b)
    with pytest.raises(TypeError, match="x has dtype"):
        grow(a, a, b)
    with pytest.raises(TypeError, match="b_lo has dtype"):
        mul(a, a, a, b)
    with pytest.raises(TypeError, match="not an MCF component dtype"):
        two_sum(torch.ones(2, dtype=F64), torch.ones(2, dtype=F64))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        two_sum(a, 1.0)


def test_the_other_entry_points_refuse_what_they_cannot_round():
    """Found by audit (2026-12-07): an integer tensor rounded twice (int64 -> float32 ->
    bf16: 2**24 + 2**16 + 1 went to 2**24, not 2**24 + 2**17); a bf16 tensor's scales read
    off float32 bit patterns it does not have; stochastic_round to float32 or float8 (a
    16-bit bit trick) failed with a shape or kernel error; ulp's bad dtype blamed x."""
    with pytest.raises(TypeError, match="x must be a floating-point torch.Tensor, got "
                                        "torch.int64"):
        round_to(torch.tensor([2**24 + 2**16 + 1]), torch.bfloat16)
    with pytest.raises(TypeError, match="x must be float32, got torch.bfloat16"):
        block_scales(torch.ones(4, dtype=torch.bfloat16), 2, 8)
    for dtype in (torch.float32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype must be torch.bfloat16 or torch.float16"):
            stochastic_round(torch.ones(4), dtype, torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="^dtype has dtype torch.float64"):
        ulp(torch.ones(2), torch.float64)


def test_combine_keeps_a_negative_zero_and_sums_in_reverse_order():
    """combine starts from its last component (0.0 + -0.0 was +0.0); its order is the
    arguments' reversed, so a sum that is not an expansion rounds (the docstring's
    example: 2**60 + 1 - 2**60 is 0, not 1)."""
    minus_zero = torch.tensor([-0.0], dtype=torch.bfloat16)
    assert math.copysign(1.0, float(combine(minus_zero))) == -1.0
    assert math.copysign(1.0, float(combine(minus_zero, minus_zero))) == -1.0
    big = torch.tensor([2.0**60])
    assert float(combine(big, torch.tensor([1.0]), -big)) == 0.0


def test_debug_checks_skip_meta_tensors():
    """A meta tensor has a shape and no values: the precondition check (a host read)
    cannot run there; it raised 'Tensor.item() cannot be called on meta tensors'."""
    a = torch.ones(2, dtype=torch.bfloat16, device="meta")
    with debug_checks():
        s, e = fast_two_sum(a, a)
    assert s.device.type == "meta" and s.shape == (2,)


@pytest.mark.parametrize(("dtype", "hi", "lo", "x", "want"), [
    (torch.bfloat16, float(torch.finfo(torch.bfloat16).max), -2.0**118, 2.0**119,
     (float(torch.finfo(torch.bfloat16).max), 2.0**118)),
    (torch.float16, 65504.0, -8.0, 16.0, (65504.0, 8.0)),
    (torch.float8_e4m3fn, 448.0, -16.0, 32.0, (448.0, 16.0)),
    (torch.float8_e4m3fn, 352.0, -8.0, 120.0, (448.0, 16.0)),
    (torch.float8_e5m2, 57344.0, -2048.0, 4096.0, (57344.0, 2048.0)),
], ids=["bf16", "fp16", "e4m3fn", "e4m3fn-352", "e5m2"])
def test_grow_past_an_overflow_of_hi_plus_x(dtype, hi, lo, x, want):
    """fl(hi + x) overflows, the whole sum does not: the sum, rounded to nearest, and its
    exact rest (by hand: e4m3fn's 448 - 16 + 32 = 464 is the tie between 448 and the nan
    code, to even: 448, rest 16). It gave inf, or nan for e4m3fn."""
    def t(value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=F64).to(dtype)

    new_hi, new_lo = grow(t(hi), t(lo), t(x))
    assert (float(new_hi), float(new_lo)) == want
    assert hi + lo + x == want[0] + want[1]  # exact here: the pair holds the sum
