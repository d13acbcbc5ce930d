"""Error-free transformations and two-component expansions on tensors.

Notation: ``fl(x)`` is x rounded to nearest-even *in the component dtype*; ``u = 2**-p`` is
that dtype's unit roundoff; ``ulp(x)`` its spacing at x. Each elementary operation below
(``_add``, ``_sub``, ``_mul``) is one correct rounding: it is computed in the format's
``working_dtype`` (float32 for bfloat16 and float16, float64 for the others) and rounded once
more with :func:`~collage.mcf.formats.round_to` (why that is correct: see formats.py).

Non-finite rule (one rule for every primitive): the leading component is exactly what the
dtype's own IEEE arithmetic gives for the operation (+-inf or nan; nan for overflow in
float8_e4m3fn, which has no inf), and every trailing component is +0 whenever the leading one
is not finite. So ``combine`` of a result equals the IEEE result, and ``isfinite(hi)`` alone
says whether an expansion is valid.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .formats import FormatInfo, format_info, round_to

__all__ = [
    "two_sum",
    "fast_two_sum",
    "two_prod",
    "grow",
    "mul",
    "split",
    "combine",
    "debug_checks",
    "checks_enabled",
]

_DEBUG = os.environ.get("COLLAGE_DEBUG", "") not in ("", "0")


def checks_enabled() -> bool:
    """Whether preconditions are checked (``COLLAGE_DEBUG=1`` or :func:`debug_checks`)."""
    return _DEBUG


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Check unchecked preconditions (e.g. fast_two_sum's ``|a| >= |b|``) inside the block.

    Checks cost a host synchronisation per call, so they are off by default.
    """
    global _DEBUG
    previous, _DEBUG = _DEBUG, enabled
    try:
        yield
    finally:
        _DEBUG = previous


def _info_of(*named: tuple[str, torch.Tensor]) -> FormatInfo:
    """The common component format of the named tensors; errors name the bad argument."""
    first_name, first = named[0]
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but {first_name} has {first.dtype}; "
                f"all components must share one dtype (convert with .to({first.dtype}))"
            )
    return format_info(first.dtype, first_name)


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide = format_info(a.dtype).working_dtype
    return round_to(a.to(wide) + b.to(wide), a.dtype)


def _sub(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide = format_info(a.dtype).working_dtype
    return round_to(a.to(wide) - b.to(wide), a.dtype)


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide = format_info(a.dtype).working_dtype
    return round_to(a.to(wide) * b.to(wide), a.dtype)


def _zero_unless_finite(lead: torch.Tensor, trailing: torch.Tensor) -> torch.Tensor:
    """The non-finite rule: trailing components are +0 where the leading one is inf/nan."""
    # Widen first: torch has no isfinite for float8_e4m3fn (nor comparisons for float8).
    return torch.where(torch.isfinite(lead.double()), trailing, torch.zeros_like(trailing))


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum: ``s = fl(a + b)`` and ``e = (a + b) - s`` exactly. No precondition.

    Six correctly rounded operations. Exact for all finite inputs whose sum does not
    overflow: the rounding error of a sum is always representable (even among subnormals,
    where addition is exact), and Knuth (TAOCP vol. 2, 4.2.2) shows the recovery below
    reconstructs it. ``|e| <= ulp(s) / 2``.

    The operands are ordered so that ``|a| <= |b|`` first (the sum and its error do not depend
    on the order): with ``a`` the larger, ``s - b`` can overflow although ``s`` does not, e.g.
    float16 ``two_sum(65504, -2544)``: s = 62976, s - b = 65520 rounds to inf, and e was nan.
    """
    _info_of(("a", a), ("b", b))
    swap = a.double().abs() > b.double().abs()
    a, b = torch.where(swap, b, a), torch.where(swap, a, b)
    s = _add(a, b)
    a_virtual = _sub(s, b)  # the part of s that came from a
    b_virtual = _sub(s, a_virtual)  # the part of s that came from b
    a_lost = _sub(a, a_virtual)  # exact: a and a_virtual agree in their leading bits
    b_lost = _sub(b, b_virtual)  # exact for the same reason
    e = _add(a_lost, b_lost)  # exact: the true error is representable (Knuth)
    return s, _zero_unless_finite(s, e)


def fast_two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's Fast2Sum: ``s = fl(a + b)``, ``e = (a + b) - s`` exactly, in 3 operations.

    Precondition (unchecked unless :func:`debug_checks`): ``|a| >= |b|`` or ``a == 0``
    elementwise. Under it, ``z = s - a`` is exact by Sterbenz's lemma (s and a are within a
    factor of two, or z is b rounded), and so is ``b - z`` (Dekker 1971).
    """
    _info_of(("a", a), ("b", b))
    if _DEBUG and a.device.type != "meta" and b.device.type != "meta":  # (no values there)
        wa, wb = a.double(), b.double()  # float8 has no comparisons or isfinite in torch
        bad = (wa.abs() < wb.abs()) & (wa != 0) & torch.isfinite(wa) & torch.isfinite(wb)
        if bool(bad.any()):
            raise ValueError(
                f"fast_two_sum precondition |a| >= |b| fails at {int(bad.sum())} element(s); "
                "use two_sum, which has no precondition"
            )
    s = _add(a, b)
    z = _sub(s, a)  # exact (Sterbenz) under the precondition
    e = _sub(b, z)  # exact: the rounding error of a + b
    return s, _zero_unless_finite(s, e)


def two_prod(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``p = fl(a * b)`` and ``e = a * b - p``.

    For every component dtype (at most 24 significant bits) the product of two components has
    at most 48 bits and is therefore exact in float64; ``p`` is that product rounded once, and
    ``a*b - p`` is a float64 subtraction of two nearby numbers, exact again. ``e`` is then
    exactly representable in the component dtype, *unless* the product underflows: when
    ``e`` needs bits below the smallest subnormal (roughly ``|a*b| < 2**(emin + p)``), ``e`` is
    the error correctly rounded, so ``p + e`` is within half a smallest subnormal of ``a*b``.
    """
    _info_of(("a", a), ("b", b))
    exact = a.double() * b.double()  # <= 48 significant bits: exact in float64
    p = round_to(exact, a.dtype)
    e = round_to(exact - p.double(), a.dtype)  # subtraction exact in float64
    return p, _zero_unless_finite(p, e)


def grow(
    hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``x`` to the expansion ``hi + lo`` and renormalise: returns ``(hi', lo')``.

    ``(s, e) = two_sum(hi, x)`` is exact; the one rounding is ``t = fl(lo + e)``; the final
    ``two_sum(s, t)`` is exact and leaves ``|lo'| <= ulp(hi')/2`` for any input pair. Hence
    ``hi' + lo' = hi + lo + x - d`` with ``|d| <= ulp(t)/2 <= u * |lo + e|``: for a normalised
    input ``|lo + e| <= (ulp(hi) + ulp(s)) / 2``, so each call errs by about ``u**2 * |hi|``.
    We finish with two_sum instead of the paper's Fast2Sum so that *any* input pair works:
    for normalised pairs ``|s| >= |t|`` holds (checked exhaustively for both float8 formats),
    but an unnormalised ``lo`` (e.g. a user-built pair) can break Fast2Sum's precondition;
    three extra operations buy no precondition.

    Overflow: where ``s = fl(hi + x)`` overflows but the whole sum does not (``lo`` of the
    other sign brings it back: ``grow(448, -16, 32)`` in float8_e4m3fn is 464, which
    rounds to 448), two_sum's exactness ends; there ``hi' = RN(hi + lo + x)``, the IEEE
    result of the sum, and ``lo' = RN(hi + lo + x - hi')`` (:func:`_past_overflow`).
    """
    _info_of(("hi", hi), ("lo", lo), ("x", x))
    s, e = two_sum(hi, x)
    t = _add(lo, e)  # the only rounding in grow
    new_hi, new_lo = two_sum(s, t)
    new_hi, new_lo = _past_overflow(hi, lo, x, s, new_hi, new_lo)
    return new_hi, _zero_unless_finite(new_hi, new_lo)


def _past_overflow(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor, s: torch.Tensor,
                   new_hi: torch.Tensor, new_lo: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """grow's result where ``s = fl(hi + x)`` is not finite and hi, lo, x are: the sum
    itself, split. Why it is exact: s overflows only where |hi + x| reaches half a spacing
    past the largest value, so both addends are within 2**(p + 2) of it (p <= 24 bits):
    ``hi + x`` is exact in float64; ``+ lo`` is rounded to odd there, and rounding a value
    rounded to odd with 53 >= p + 2 bits to p bits is rounding the exact value (Boldo &
    Melquiond, 2008), for the head and (its spacing at most 2**(2p + 2) finer) the tail."""
    wide_hi, wide_lo, wide_x = hi.double(), lo.double(), x.double()
    past = (torch.isfinite(wide_hi) & torch.isfinite(wide_lo) & torch.isfinite(wide_x)
            & ~torch.isfinite(s.double()))
    whole_hi, whole_lo = split(_rounded_to_odd(wide_hi + wide_x, wide_lo), hi.dtype, 2)
    return torch.where(past, whole_hi, new_hi), torch.where(past, whole_lo, new_lo)


def _rounded_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 ``a + b`` rounded to odd: the nearest float64 if exact, else whichever of the
    two float64 around the sum has an odd last bit (TwoSum's error says which side)."""
    s = a + b
    b_virtual = s - a
    error = (a - (s - b_virtual)) + (b - b_virtual)  # a + b - s, exactly (Knuth)
    bits = s.view(torch.int64)
    even = (bits & 1) == 0
    # one step along the integer view: away from zero where the error has s's sign
    step = torch.where((error > 0) == (s > 0), 1, -1)
    return torch.where((error != 0) & even, bits + step, bits).view(torch.float64)


def mul(
    hi: torch.Tensor, lo: torch.Tensor, b_hi: torch.Tensor, b_lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiply the expansion ``hi + lo`` by ``b_hi + b_lo``: returns ``(z_hi, z_lo)``.

    Double-word times double-word ("DWTimesDW1", Joldes, Muller & Popescu, ACM TOMS 2017)::

        (c_hi, c_lo1) = two_prod(hi, b_hi)       # exact
        c_lo2 = fl(fl(hi * b_lo) + fl(lo * b_hi))
        (z_hi, z_lo) = fast_two_sum(c_hi, fl(c_lo1 + c_lo2))

    Relative error at most ``7 u**2`` for normalised inputs without underflow. Every input is
    read before anything is written: the research code computed the product's "error" after
    overwriting its input (harmless only when ``b_hi == 1``, e.g. bf16(0.999)), one of the
    three defects that make its Collage-plus second moment drift (docs/research_plus.md).
    The fast_two_sum precondition holds because ``|c_lo1 + c_lo2| <~ 3u |c_hi|``.
    """
    _info_of(("hi", hi), ("lo", lo), ("b_hi", b_hi), ("b_lo", b_lo))
    c_hi, c_lo1 = two_prod(hi, b_hi)
    c_lo2 = _add(_mul(hi, b_lo), _mul(lo, b_hi))
    z_hi, z_lo = fast_two_sum(c_hi, _add(c_lo1, c_lo2))
    # Non-finite rule: where hi * b_hi is inf/nan, that IEEE product is the result (the tail
    # terms would turn inf into nan: inf * 0, or inf - inf when the cross products overflow).
    z_hi = torch.where(torch.isfinite(c_hi.double()), z_hi, c_hi)
    return z_hi, _zero_unless_finite(z_hi, z_lo)


def split(x: torch.Tensor, dtype: torch.dtype, n: int = 2) -> tuple[torch.Tensor, ...]:
    """Split a wide tensor into ``n`` components of ``dtype``, largest first.

    Component ``k`` is ``fl(x - c_0 - ... - c_{k-1})`` with the remainder kept exactly in
    float64 (``r - fl(r)`` is exact by Sterbenz's lemma). Components therefore do not overlap:
    ``|c_{k+1}| <= ulp(c_k)/2``. The recombination error is the last remainder, at most
    ``u**n * |x|`` in relative terms (``2**-16`` for two bf16 components), and zero once the
    components hold all of x's bits: three bf16 components hold any float32 whose last bit
    is at least bf16's smallest subnormal ``2**-133`` (every normal float32 of magnitude at
    least ``2**-110``; below that float32 has bits bf16 cannot represent).
    Overflow and non-finite x follow the module's non-finite rule.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point torch.Tensor")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    format_info(dtype, "dtype")
    remainder = x.to(torch.float64)
    components = []
    for _ in range(n):
        component = round_to(remainder, dtype)
        remainder = remainder - component.double()  # exact (Sterbenz, or component == 0)
        components.append(component)
    lead = components[0]
    return (lead,) + tuple(_zero_unless_finite(lead, c) for c in components[1:])


def combine(*components: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sum components into ``dtype``: exact for the expansions this module makes.

    Components are added in float64 from the last to the first (for an expansion, largest
    first: smallest first). For non-overlapping expansions of up to 48 significant bits
    (three bf16 or fp16 components, two float32 ones) every partial sum is representable,
    so the float64 result is exact and a final cast to a narrower ``dtype`` rounds once.
    Other components are summed in that order with float64 roundings
    (``combine(2**60, 1, -2**60)`` is 0). Non-finite leading components give the IEEE
    result (the non-finite rule); zeros keep IEEE's sign (``-0 + -0`` is -0).
    """
    if not components:
        raise ValueError("combine needs at least one component")
    # the last component first, not 0.0 + it: +0 + -0 is +0, which would lose a lone -0
    total = components[-1].to(torch.float64)
    for component in reversed(components[:-1]):
        total = total + component.to(torch.float64)
    if dtype == torch.float64:
        return total
    return round_to(total, dtype)
