"""Component formats and correctly rounded conversion into them.

Every MCF primitive computes each elementary operation in a wider format (float64; float32
for bfloat16 and float16, see below) and rounds that result *once more* to the component dtype
with :func:`round_to`. For float64, two facts make that a single correct rounding of the
exact result:

* float64 carries q = 53 significant bits, and q >= 2p + 2 for every component format here
  (p = 24 for float32, 11 for float16, 8 for bfloat16, 4 for e4m3, 3 for e5m2). By
  Figueroa's theorem ("When is double rounding innocuous?", SIGNUM 1995) rounding the exact
  result of +, -, *, / or sqrt first to q bits and then to p bits equals rounding it once to
  p bits. float64's exponent range also contains every component format's, subnormals
  included, so the first rounding never under- or overflows.
* :func:`round_to` itself rounds a float64 correctly. PyTorch's own ``float64 -> bfloat16``
  cast goes through float32 and rounds twice (``1 + 2**-8 + 2**-40`` becomes ``1.0``, not
  ``1 + 2**-7``), so we first round to float32 *to odd* and only then to nearest-even: with
  at least p + 2 bits in the intermediate, round-to-odd followed by round-to-nearest is a
  correct rounding (Boldo & Melquiond, "When double rounding is odd", 2005).

For bfloat16 and float16 the primitives' sums, differences and products (``eft``'s
``_add``, ``_sub``, ``_mul``) take float32 as the first format instead: four to six times
faster up to thousands of elements (``grow`` three times). q = 24 >= 2p + 2 for p = 8 and
11, so Figueroa's theorem applies where the exact result is normal in float32. float32's
exponent range contains float16's; it is bfloat16's own, and below float32's normal range a
sum of two bfloat16 values is exact in float32 and a product rounds there to the same
neighbours. That last step is the weak point of the argument, so every pair of each format
(2**32, specials included) was checked against an integer reference:
``benchmarks/studies/double_rounding_check.c``, no mismatch
(docs/benchmarks/amd-epyc-2c_2026-12-07_double-rounding.txt). The second rounding,
float32 -> bfloat16 or float16, is PyTorch's cast, which rounds to nearest even.

Overflow follows the format: to +-inf where the format has infinities. ``float8_e4m3fn`` has
none, and PyTorch's cast *saturates* to +-448 (even for inf); saturation would silently lose
an update, so :func:`round_to` maps overflow (and +-inf) to nan for that format instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FormatInfo", "format_info", "round_to", "ulp", "COMPONENT_DTYPES"]


@dataclass(frozen=True)
class FormatInfo:
    """Numbers that describe one component format.

    ``precision`` counts significant bits including the implicit one (bf16: 8, fp32: 24).
    ``min_exponent`` is the exponent of the smallest normal number (bf16: -126).
    ``overflow_threshold`` is the smallest magnitude that rounds to overflow under
    round-to-nearest-even (max_finite + ulp(max_finite)/2 when max_finite's significand is
    odd, as for every format here except e4m3fn, whose threshold is exclusive).
    """

    dtype: torch.dtype
    precision: int
    min_exponent: int
    max_finite: float
    has_inf: bool

    @property
    def unit_roundoff(self) -> float:
        """u = 2**-p: the relative error bound of one rounding to nearest."""
        return 2.0 ** -self.precision

    @property
    def working_dtype(self) -> torch.dtype:
        """Where a sum, difference or product of two components is computed before
        :func:`round_to` rounds it once more: float32 for bfloat16 and float16, float64 for
        the others (why either is one correct rounding: the module docstring)."""
        return torch.float32 if self.dtype in _VIA_FLOAT32 else torch.float64

    @property
    def smallest_normal(self) -> float:
        return 2.0**self.min_exponent

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.precision + 1)


#: The formats whose elementary operations go through float32 (the module docstring)
_VIA_FLOAT32 = (torch.bfloat16, torch.float16)

COMPONENT_DTYPES: dict[torch.dtype, FormatInfo] = {
    torch.float32: FormatInfo(torch.float32, 24, -126, torch.finfo(torch.float32).max, True),
    torch.bfloat16: FormatInfo(torch.bfloat16, 8, -126, torch.finfo(torch.bfloat16).max, True),
    torch.float16: FormatInfo(torch.float16, 11, -14, 65504.0, True),
    torch.float8_e4m3fn: FormatInfo(torch.float8_e4m3fn, 4, -6, 448.0, False),
    torch.float8_e5m2: FormatInfo(torch.float8_e5m2, 3, -14, 57344.0, True),
}


def format_info(dtype: torch.dtype, argument: str = "dtype") -> FormatInfo:
    """Return the :class:`FormatInfo` of a component dtype; a clear TypeError otherwise."""
    try:
        return COMPONENT_DTYPES[dtype]
    except KeyError:
        valid = ", ".join(str(d) for d in COMPONENT_DTYPES)
        raise TypeError(
            f"{argument} has dtype {dtype}, which is not an MCF component dtype; "
            f"use one of: {valid}"
        ) from None


def _round_to_odd_float32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 ``x`` to float32 with round-to-odd.

    Round-to-odd truncates towards zero and, if anything was discarded, sets the last bit::

        float32 bits: s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm
                                                      ^ forced to 1 when inexact ("sticky")

    Stepping the integer view by -1 moves the magnitude one ulp towards zero for either sign
    (IEEE layout is sign-magnitude), and turns +-inf into +-max_finite.
    """
    rounded = x.to(torch.float32)
    inexact = rounded.to(torch.float64) != x
    inexact &= ~torch.isnan(x)
    bits = rounded.view(torch.int32)
    overshot = inexact & (rounded.to(torch.float64).abs() > x.abs())
    bits = torch.where(overshot, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` correctly (to nearest, ties to even) in one rounding.

    Works from any floating dtype (an integer tensor is refused: its conversion to a float
    would round once more). Overflow gives +-inf, or nan for ``float8_e4m3fn`` (see the
    module docstring); nan stays nan.
    """
    info = format_info(dtype)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}; "
                        "convert it first (an integer's conversion to float rounds too)")
    if x.dtype == dtype:
        return x
    if x.dtype == torch.float64 and dtype != torch.float32:
        # float32 has >= p + 2 bits for every narrower format, so odd-then-even is correct.
        narrowed = _round_to_odd_float32(x)
    else:
        # float32 and narrower sources: the widening to float32 is exact and the cast rounds
        # once; float64 -> float32 is a single hardware rounding.
        narrowed = x.to(torch.float32)
    out = narrowed.to(dtype)
    if not info.has_inf:
        # Values at or below the threshold round to max_finite; above it (and +-inf) overflow.
        # e4m3fn: 464 = 448 + 16 is the tie between 448 (even) and 480 (odd, the nan code).
        threshold = info.max_finite + 2.0 ** (_exponent_of_max(info) - info.precision)
        overflow = narrowed.abs() > threshold
        out = torch.where(overflow, torch.full_like(out, float("nan")), out)
    return out


def _exponent_of_max(info: FormatInfo) -> int:
    return int(torch.tensor(info.max_finite, dtype=torch.float64).frexp()[1].item()) - 1


def ulp(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unit in the last place of ``x`` in ``dtype`` (default: x's dtype), as float64.

    ``ulp(x) = 2**(max(e, emin) - p + 1)`` where ``2**e <= |x| < 2**(e+1)``; for zero it is
    the smallest subnormal; nan for inf and nan. Exact: a power of two in float64.
    """
    info = format_info(dtype, "dtype") if dtype is not None else format_info(x.dtype, "x")
    wide = x.to(torch.float64)
    _, exponent = torch.frexp(wide)
    binade = torch.clamp(exponent.to(torch.float64) - 1, min=info.min_exponent)
    binade = torch.where(wide == 0, torch.full_like(binade, info.min_exponent), binade)
    out = torch.exp2(binade - (info.precision - 1))
    return torch.where(torch.isfinite(wide), out, torch.full_like(out, float("nan")))
