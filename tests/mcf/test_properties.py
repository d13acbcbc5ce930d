"""Property tests (hypothesis) for every component dtype, checked with the exact reference.

Inputs are drawn as raw bit patterns, so hypothesis reaches every binade, subnormals, signed
zeros and the format's extremes (it favours boundary integers such as 0 and all-ones).
Derandomized, no deadline, sized so the whole tests/mcf suite stays well under 90 s.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collage.mcf import fast_two_sum, grow, split, two_prod, two_sum

from . import exact as X
from .exact import F64, one_torch_thread  # noqa: F401 (autouse fixture)

DTYPE_PARAMS = [pytest.param(d, id=X.dtype_id(d)) for d in X.DTYPES]
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)


def _finite(bits: list[int], dtype) -> torch.Tensor:
    x = X.from_bits(torch.tensor(bits, dtype=torch.int64), dtype)
    return torch.where(X.isfinite(x), x, torch.zeros_like(x))  # nan/inf patterns become 0


def pairs(dtype):
    """Batches of up to 48 pairs of finite component values, drawn as bit patterns."""
    word = st.integers(0, (1 << X.FORMATS[dtype].width) - 1)
    return st.lists(st.tuples(word, word), min_size=1, max_size=48).map(
        lambda ps: (_finite([p[0] for p in ps], dtype), _finite([p[1] for p in ps], dtype))
    )


def assert_exact_sum(a, b, s, e):
    """s + e == a + b exactly and |e| <= ulp(s)/2 where s is finite (the non-finite rule
    otherwise: e == +0)."""
    s64, e64 = s.to(F64), e.to(F64)
    fin = X.isfinite(s64)
    sa, ea = X.exact_sum(a[fin], b[fin])
    assert bool(X.pair_equal(s64[fin], e64[fin], sa, ea).all()), (a, b, s, e)
    assert bool((e64[fin].abs() <= X.ulp(s64[fin], a.dtype) / 2).all()), (a, b, s, e)
    X.assert_positive_zero(e[~fin], "e where s is not finite")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_two_sum_is_error_free(dtype):
    @SETTINGS
    @given(pairs(dtype))
    def prop(ab):
        a, b = ab
        s, e = two_sum(a, b)
        X.assert_same(s, X.ref_two_sum(a, b)[0], "s == RN(a + b)", a, b)
        assert_exact_sum(a, b, s, e)

    prop()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_fast_two_sum_is_error_free_when_ordered(dtype):
    @SETTINGS
    @given(pairs(dtype))
    def prop(ab):
        x, y = ab
        swap = x.to(F64).abs() < y.to(F64).abs()
        a, b = torch.where(swap, y, x), torch.where(swap, x, y)  # |a| >= |b|
        s, e = fast_two_sum(a, b)
        assert_exact_sum(a, b, s, e)

    prop()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_two_prod_is_error_free_without_underflow(dtype):
    @SETTINGS
    @given(pairs(dtype))
    def prop(ab):
        a, b = ab
        p, e = two_prod(a, b)
        p64, e64 = p.to(F64), e.to(F64)
        ok = X.isfinite(p64) & X.no_product_underflow(a, b)
        prod = X.exact_product(a, b)
        assert bool(X.pair_equal(p64[ok], e64[ok], prod[ok], torch.zeros_like(prod[ok])).all()), (
            a,
            b,
            p,
            e,
        )

    prop()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_grow_stays_normalised(dtype):
    @SETTINGS
    @given(pairs(dtype), st.floats(-1.0, 1.0))
    def prop(ab, r):
        hi, x = ab
        half = X.ulp(hi.to(F64), dtype) / 2
        lo = X.round_exact(half * r, dtype).to(dtype)  # |lo| <= ulp(hi)/2
        h2, l2 = grow(hi, lo, x)
        h64, l64 = h2.to(F64), l2.to(F64)
        fin = X.isfinite(h64)
        assert bool((l64[fin].abs() <= X.ulp(h64[fin], dtype) / 2).all()), (hi, lo, x, h2, l2)
        X.assert_positive_zero(l2[~fin], "grow tail where the lead is not finite")

    prop()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_split_components_do_not_overlap(dtype):
    @SETTINGS
    @given(
        st.lists(
            st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=48
        ),
        st.integers(2, 3),
    )
    def prop(xs, n):
        x = torch.tensor(xs, dtype=F64)
        comps = split(x, dtype, n)
        lead_fin = X.isfinite(comps[0])
        for c, d in zip(comps, comps[1:]):
            c64, d64 = c.to(F64), d.to(F64)
            fin = X.isfinite(c64)
            assert bool((d64[fin].abs() <= X.ulp(c64[fin], dtype) / 2).all()), (x, comps)
            X.assert_positive_zero(d[~lead_fin], "split tail of a non-finite lead")

    prop()
