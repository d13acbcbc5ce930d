"""An exact reference for the MCF tests, written without any ``collage`` code.

Everything here is vectorised torch float64/int64 and exact by construction:

* Formats are described from their bit layouts (IEEE 754 and the OCP FP8 spec), not from
  ``collage.mcf.formats``; values are decoded from bit patterns with integer arithmetic.
* A sum of two component values is held as a float64 TwoSum pair ``(S, E)``: ``S = RN64(a+b)``
  and ``E = a + b - S`` exactly (float64 arithmetic is correctly rounded, and Knuth's TwoSum
  recovers the error). The pair is canonical: two exact sums are equal iff their pairs are.
* A product of two components has at most 2 * 24 = 48 significant bits, so the float64
  product is exact (checked here with Dekker's product anyway).
* :func:`round_pair` rounds an exact pair to a format by integer-style arithmetic on the
  quantum ``q = 2**(max(e, emin) - p + 1)``: ``n = floor(|S| / q)``, the fraction decides,
  ``E`` breaks ties, ties go to even ``n``; overflow gives inf (nan for e4m3fn).
* :func:`sum_sign` gives the exact sign of a sum of many float64 terms (Shewchuk's
  grow-expansion), so error *bounds* can be checked exactly too, never with a tolerance.

:func:`fraction_round` is a second, tiny reference on Python Fractions; the tests use it to
cross-check this module on a few thousand samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run the MCF tests on one intra-op thread, restoring the setting afterwards.

    The tensors here are a few million elements of cheap elementwise work. On a shared 2-core
    machine, two OpenMP threads gain little and, when other processes compete for the cores,
    their synchronisation made the suite ~5x slower (220 s vs 47 s measured under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass(frozen=True)
class Fmt:
    """A binary format described by its bit layout."""

    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits (the implicit leading one is not stored)
    ieee_specials: (
        bool  # True: all-ones exponent is inf/nan. False (e4m3fn): only S.1111.111 is nan
    )

    @property
    def width(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def p(self) -> int:
        return self.mantissa_bits + 1

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        top = 2**self.exponent_bits - 1
        return (top - 1 if self.ieee_specials else top) - self.bias

    @property
    def has_inf(self) -> bool:
        return self.ieee_specials

    @property
    def max_finite(self) -> float:
        # All-ones significand, except e4m3fn where S.1111.111 is the nan code.
        top_fraction = 2**self.mantissa_bits - 1 - (0 if self.ieee_specials else 1)
        return math.ldexp(2**self.mantissa_bits + top_fraction, self.emax - self.mantissa_bits)

    @property
    def u(self) -> float:
        return 2.0**-self.p

    @property
    def smallest_normal(self) -> float:
        return 2.0**self.emin

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.p + 1)

    @property
    def int_dtype(self) -> torch.dtype:
        return {8: torch.uint8, 16: torch.int16, 32: torch.int32}[self.width]


FORMATS: dict[torch.dtype, Fmt] = {
    torch.float32: Fmt(torch.float32, 8, 23, True),
    torch.bfloat16: Fmt(torch.bfloat16, 8, 7, True),
    torch.float16: Fmt(torch.float16, 5, 10, True),
    torch.float8_e4m3fn: Fmt(torch.float8_e4m3fn, 4, 3, False),
    torch.float8_e5m2: Fmt(torch.float8_e5m2, 5, 2, True),
}
DTYPES = list(FORMATS)
NARROW_DTYPES = [d for d in DTYPES if FORMATS[d].width <= 16]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# Bits and values
# --------------------------------------------------------------------------------------------


def isfinite(x: torch.Tensor) -> torch.Tensor:
    """torch.isfinite for float64 (and any float8 via widening), several times faster here."""
    return x.to(F64).abs() < math.inf  # nan compares False


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**k`` for integer tensors with -1022 <= k <= 1023, built from float64 bits."""
    k = k.to(torch.int64)
    return ((k + 1023) << 52).view(F64)


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a component tensor as non-negative int64."""
    fmt = FORMATS[x.dtype]
    return x.view(fmt.int_dtype).to(torch.int64) & ((1 << fmt.width) - 1)


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Component tensor with the given bit patterns (taken modulo 2**width)."""
    fmt = FORMATS[dtype]
    b = bits.to(torch.int64) & ((1 << fmt.width) - 1)
    if fmt.int_dtype != torch.uint8:  # signed storage: map the upper half to negatives
        b = torch.where(b >= (1 << (fmt.width - 1)), b - (1 << fmt.width), b)
    return b.to(fmt.int_dtype).view(dtype)


def decode(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Value of each bit pattern as float64, by integer arithmetic on sign/exponent/fraction."""
    fmt = FORMATS[dtype]
    b = bits.to(torch.int64)
    sign = (b >> (fmt.width - 1)) & 1
    field = (b >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    frac = b & ((1 << fmt.mantissa_bits) - 1)
    significand = torch.where(field == 0, frac, frac + (1 << fmt.mantissa_bits)).to(F64)
    exponent = torch.where(field == 0, fmt.emin, field - fmt.bias) - fmt.mantissa_bits
    mag = significand * pow2(exponent)
    top = (1 << fmt.exponent_bits) - 1
    if fmt.ieee_specials:
        mag = torch.where((field == top) & (frac == 0), math.inf, mag)
        mag = torch.where((field == top) & (frac != 0), math.nan, mag)
    else:
        mag = torch.where((field == top) & (frac == (1 << fmt.mantissa_bits) - 1), math.nan, mag)
    return torch.where(sign == 1, -mag, mag)


def all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit format (nan, inf and signed zeros included)."""
    fmt = FORMATS[dtype]
    assert fmt.width <= 16
    return from_bits(torch.arange(1 << fmt.width, dtype=torch.int64), dtype)


def random_values(
    dtype: torch.dtype, n: int, gen: torch.Generator, finite: bool = True
) -> torch.Tensor:
    """Uniformly random bit patterns (so every binade, subnormals included, is equally likely)."""
    fmt = FORMATS[dtype]
    bits = torch.randint(0, 1 << fmt.width, (n,), generator=gen, dtype=torch.int64)
    x = from_bits(bits, dtype)
    if finite:
        x = torch.where(isfinite(x), x, torch.zeros_like(x))
    return x


def values_from_parts(
    sign: torch.Tensor, mantissa: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``sign * mantissa * 2**exponent`` for integer mantissas < 2**p, clipped to be representable.

    The exponent is raised so the value is a multiple of the smallest subnormal (bits are
    dropped by flooring, not rounding) and lowered so the value stays <= max_finite.
    """
    fmt = FORMATS[dtype]
    m = mantissa.to(torch.int64) % (1 << fmt.p)
    k = exponent.to(torch.int64)
    lowest = fmt.emin - fmt.p + 1
    shift = torch.clamp(lowest - k, min=0, max=62)
    m = m >> shift
    k = torch.maximum(k, torch.full_like(k, lowest))
    v = m.to(F64) * pow2(torch.clamp(k, -1000, 1000))
    v = torch.where(v > fmt.max_finite, fmt.max_finite, v)
    v = torch.where(sign < 0, -v, v)
    out = v.to(dtype)
    assert torch.equal(out.to(F64), v), "values_from_parts built a value that is not representable"
    return out


def special_values(dtype: torch.dtype, every: int = 1) -> torch.Tensor:
    """Signed zeros, subnormal and normal extremes, 1 and its neighbours, a power of two and
    an all-ones significand in every ``every``-th binade, largest finite and its neighbour, and
    the non-finite values of the format."""
    fmt = FORMATS[dtype]
    sub = fmt.smallest_subnormal
    mags = [
        0.0,
        sub,
        2 * sub,
        3 * sub,
        fmt.smallest_normal - sub,
        fmt.smallest_normal,
        fmt.smallest_normal + 2.0 ** (fmt.emin - fmt.p + 1),
        1.0,
        1.0 + 2.0 ** (1 - fmt.p),
        1.0 - 2.0**-fmt.p,
        1.5,
        fmt.max_finite,
        fmt.max_finite - 2.0 ** (fmt.emax - fmt.p + 1),
        2.0**fmt.emax,
    ]
    mags += [2.0**k for k in range(fmt.emin - fmt.p + 1, fmt.emax + 1, every)]
    mags += [(2.0 - 2.0 ** (1 - fmt.p)) * 2.0**k for k in range(fmt.emin, fmt.emax, every)]
    v = torch.tensor(sorted(set(mags)), dtype=F64)
    v = torch.cat([v, -v])
    out = v.to(dtype)
    assert torch.equal(out.to(F64), v)
    extra = [math.nan] + ([math.inf, -math.inf] if fmt.has_inf else [])
    return torch.cat([out, torch.tensor(extra, dtype=F64).to(dtype)])


# --------------------------------------------------------------------------------------------
# Exact float64 building blocks
# --------------------------------------------------------------------------------------------


def two_sum64(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum in float64: ``S = RN64(a + b)``, ``E = a + b - S`` exactly.

    Where S is not finite, E is 0 (there is no exact error to speak of)."""
    s = a + b
    bv = s - a
    av = s - bv
    e = (a - av) + (b - bv)
    return s, torch.where(isfinite(s), e, torch.zeros_like(e))


def exact_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact sum of two component tensors as a canonical float64 pair."""
    return two_sum64(a.to(F64), b.to(F64))


def exact_product(a: torch.Tensor, b: torch.Tensor, verify: bool = False) -> torch.Tensor:
    """The exact product of two component tensors (<= 48 significant bits) in float64.

    ``verify=True`` re-checks exactness with Dekker's product (Veltkamp splitting)."""
    x, y = a.to(F64), b.to(F64)
    p = x * y
    if verify:
        ok = isfinite(p) & (p != 0)
        xs, ys = torch.where(ok, x, 1.0), torch.where(ok, y, 1.0)
        c = 134217729.0  # 2**27 + 1
        gx, gy = c * xs, c * ys
        xh, yh = gx - (gx - xs), gy - (gy - ys)
        xl, yl = xs - xh, ys - yh
        pp = xs * ys
        err = (((xh * yh - pp) + xh * yl) + xl * yh) + xl * yl
        assert bool((err[ok] == 0).all()), "a component product was not exact in float64"
    return p


def pair_equal(
    s1: torch.Tensor, e1: torch.Tensor, s2: torch.Tensor, e2: torch.Tensor, canonical: bool = False
) -> torch.Tensor:
    """Elementwise: do the exact values s1 + e1 and s2 + e2 agree? Both pairs are brought to
    canonical form (S = RN64(sum)) first; ``canonical=True`` says (s2, e2) already is one."""
    a_s, a_e = two_sum64(s1, e1)
    b_s, b_e = (s2, e2) if canonical else two_sum64(s2, e2)
    return (a_s == b_s) & (a_e == b_e)


def sum_sign(terms: list[torch.Tensor]) -> torch.Tensor:
    """Exact sign (-1, 0, 1) of the sum of finite float64 tensors.

    Shewchuk's grow-expansion adds the terms into a non-overlapping expansion (every TwoSum is
    exact); the sign of a non-overlapping expansion is the sign of its largest component."""
    comps: list[torch.Tensor] = []
    for t in terms:
        q = t.to(F64)
        grown = []
        for c in comps:
            q, err = two_sum64(q, c)
            grown.append(err)
        grown.append(q)
        comps = grown
    sign = torch.zeros_like(comps[0])
    for c in reversed(comps):  # largest component last
        sign = torch.where(sign == 0, torch.sign(c), sign)
    return sign


def sum_approx(terms: list[torch.Tensor]) -> torch.Tensor:
    """float64 approximation of a sum (for messages and printing only, never for asserts)."""
    total = torch.zeros_like(terms[0], dtype=F64)
    for t in terms:
        total = total + t.to(F64)
    return total


def exponent_of(x: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) for finite nonzero float64 x (exact: read off frexp)."""
    _, e = torch.frexp(x)
    return e.to(torch.int64) - 1


# --------------------------------------------------------------------------------------------
# Correct rounding of exact values
# --------------------------------------------------------------------------------------------


def round_pair(s: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round the exact value ``s + e`` (a canonical float64 pair) to nearest-even in ``dtype``.

    Returns float64 holding the rounded value: +-inf on overflow (nan for e4m3fn, which has no
    infinity), nan for nan. A zero result carries the sign of ``s``.
    """
    fmt = FORMATS[dtype]
    finite = isfinite(s)
    e = torch.where(finite, e, torch.zeros_like(e))
    mag = torch.where(finite, s.abs(), torch.ones_like(s))
    direction = torch.sign(e) * torch.where(s < 0, -1.0, 1.0)  # +1: true |value| exceeds |s|
    binade = torch.where(mag > 0, exponent_of(torch.where(mag > 0, mag, 1.0)), fmt.emin)
    quantum_exp = torch.clamp(binade, min=fmt.emin) - fmt.p + 1
    scaled = mag / pow2(quantum_exp)  # exact: division by a power of two
    n = torch.floor(scaled)
    frac = scaled - n  # exact: scaled has at most 53 bits
    odd = torch.remainder(n, 2) == 1
    up = (frac > 0.5) | ((frac == 0.5) & ((direction > 0) | ((direction == 0) & odd)))
    value = (n + up.to(F64)) * pow2(quantum_exp)
    overflow_to = math.inf if fmt.has_inf else math.nan
    value = torch.where(value > fmt.max_finite, overflow_to, value)
    value = torch.where(s < 0, -value, value)
    value = torch.where((value == 0) & (s.view(torch.int64) < 0), -0.0, value)  # keep -0
    nonfinite = s if fmt.has_inf else torch.full_like(s, math.nan)
    return torch.where(finite, value, nonfinite)


def round_exact(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Correctly round float64 values (taken as exact) to ``dtype``; float64 result."""
    x = x.to(F64)
    return round_pair(x, torch.zeros_like(x), dtype)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**(max(floor(log2|x|), emin) - p + 1)`` as float64; smallest subnormal at 0; nan if
    x is not finite."""
    fmt = FORMATS[dtype]
    x = x.to(F64)
    mag = x.abs()
    nz = isfinite(mag) & (mag > 0)
    binade = torch.where(nz, exponent_of(torch.where(nz, mag, 1.0)), fmt.emin)
    out = pow2(torch.clamp(binade, min=fmt.emin) - fmt.p + 1)
    return torch.where(isfinite(x), out, math.nan)


def ref_two_sum(
    a: torch.Tensor, b: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What two_sum must return, from exact arithmetic: ``s = RN(a+b)``; ``e = a + b - s``
    exactly; ``e = +0`` where s is not finite. ``exact``: the pair exact_sum(a, b), if known."""
    big, small = exact if exact is not None else exact_sum(a, b)
    s = round_pair(big, small, a.dtype)
    fin = isfinite(s)
    sf = torch.where(fin, s, 0.0)
    head = big - sf  # exact: Sterbenz (big and s both approximate a + b to within 12.5%)
    e, rest = two_sum64(head, small)
    # e is the exact error (rest == 0). That it is representable in the format (Knuth) is
    # checked where it is compared with a component value.
    assert bool((rest[fin] == 0).all()), "rounding error of a sum not representable in float64"
    return s, torch.where(fin, e, 0.0)


def ref_two_prod(
    a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``p = RN(a*b)``, ``e = RN(a*b - p)`` (+0 where p is not finite), and the exact product."""
    prod = exact_product(a, b)
    p = round_pair(prod, torch.zeros_like(prod), a.dtype)
    fin = isfinite(p)
    diff = torch.where(fin, prod - torch.where(fin, p, 0.0), 0.0)  # exact: Sterbenz or p == 0
    e = round_exact(diff, a.dtype)
    return p, torch.where(fin, e, 0.0), prod


def no_product_underflow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sufficient condition for ``a*b - RN(a*b)`` to be representable: a or b is zero, or
    ``ea + eb >= emin + p - 1`` where ``ex = max(floor(log2|x|), emin)``.

    Why: a*b is a multiple of ``ulp(a) * ulp(b) = 2**(ea + eb - 2p + 2)``, so its rounding error
    is too; it has at most p bits; it is representable once that quantum is at least the
    smallest subnormal ``2**(emin - p + 1)``."""
    fmt = FORMATS[a.dtype]
    x, y = a.to(F64).abs(), b.to(F64).abs()
    ex = torch.clamp(exponent_of(torch.where(x > 0, x, 1.0)), min=fmt.emin)
    ey = torch.clamp(exponent_of(torch.where(y > 0, y, 1.0)), min=fmt.emin)
    return (x == 0) | (y == 0) | (ex + ey >= fmt.emin + fmt.p - 1)


# --------------------------------------------------------------------------------------------
# A second, slow reference on Python Fractions (used to check the one above)
# --------------------------------------------------------------------------------------------


def fraction_round(v: Fraction, dtype: torch.dtype, negative_zero: bool = False) -> float:
    """Round a rational to nearest-even in ``dtype`` with exact rational arithmetic."""
    fmt = FORMATS[dtype]
    if v == 0:
        return -0.0 if negative_zero else 0.0
    mag = abs(v)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    q = Fraction(2) ** (max(e, fmt.emin) - fmt.p + 1)
    n, rest = divmod(mag, q)  # n = floor(mag / q), rest = mag - n*q
    if 2 * rest > q or (2 * rest == q and n % 2 == 1):
        n += 1
    rounded = n * q
    if rounded > Fraction(fmt.max_finite):
        return math.copysign(math.inf, v) if fmt.has_inf else math.nan
    return math.copysign(float(rounded), v)  # an underflow to zero keeps v's sign


def fraction_round_by_table(
    v: Fraction, table: list[tuple[Fraction, int]], dtype: torch.dtype
) -> float:
    """Round by brute force over a sorted table of (value, bits) of every finite value plus
    the value one step past max_finite: nearest wins; a tie goes to the even bit pattern."""
    fmt = FORMATS[dtype]
    best = min(table, key=lambda vb: (abs(vb[0] - v), vb[1] & 1))
    if abs(best[0]) > Fraction(fmt.max_finite):
        return math.copysign(math.inf, v) if fmt.has_inf else math.nan
    return math.copysign(float(best[0]), v)  # a zero result keeps the sign of v


# --------------------------------------------------------------------------------------------
# Comparing results
# --------------------------------------------------------------------------------------------


def assert_same(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str,
    *inputs: torch.Tensor,
    signed_zero: bool = True,
) -> None:
    """``actual`` equals ``expected`` exactly: nan where expected is nan, and elsewhere the
    same float64 bit pattern (so -0 and +0 differ) or, with ``signed_zero=False``, the same
    value. The message shows the first mismatches with their inputs."""
    a, x = actual.to(F64).reshape(-1), expected.to(F64).reshape(-1)
    assert a.shape == x.shape, f"{what}: shape {tuple(a.shape)} != {tuple(x.shape)}"
    both_nan = a.isnan() & x.isnan()
    same = (a.view(torch.int64) == x.view(torch.int64)) if signed_zero else (a == x)
    same = same | both_nan
    if not bool(same.all()):
        bad = (~same).nonzero().reshape(-1)
        shown = []
        for i in bad[:6].tolist():
            args = ", ".join(repr(t.to(F64).reshape(-1)[i].item()) for t in inputs)
            shown.append(f"  inputs ({args}): got {a[i].item()!r}, expected {x[i].item()!r}")
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} differ\n" + "\n".join(shown))


def assert_positive_zero(t: torch.Tensor, what: str) -> None:
    """Every element is +0 (bit pattern all zeros)."""
    assert bool(
        (bits_of(t) == 0).all()
    ), f"{what}: expected +0 everywhere, got {t[bits_of(t) != 0][:6]}"
