"""Rounding helpers shared by the kernels: stochastic rounding and the bit layout of the
``split`` strategy."""

from __future__ import annotations

import torch

from ..mcf.formats import round_to

__all__ = ["stochastic_round", "split_encode", "split_decode"]


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, randomness: torch.Generator | torch.Tensor | None
) -> torch.Tensor:
    """Round ``x`` (float32 or float64) to the 16-bit ``dtype`` stochastically, unbiased.

    With ``r`` the nearest value and ``n`` its neighbour on the other side of ``x``, returns
    ``n`` with probability ``|x - r| / |n - r|``, so ``E[result] == x`` exactly (up to the
    2**-24 resolution of the uniform draw). The neighbour is found on the integer view: IEEE
    formats are sign-magnitude, so magnitude +-1 is one ulp away from or towards zero.
    Non-finite values and overflow are rounded to nearest. ``randomness`` is a generator to
    draw ``torch.rand(x.shape)`` from, or those float32 draws already made (the compiled
    path draws outside the compiled region so that the seeded stream is the same).
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"stochastic_round: dtype must be torch.bfloat16 or torch.float16, got "
                        f"{dtype} (the neighbour is found on the 16-bit integer view)")
    if (dtype == torch.bfloat16 and x.dtype == torch.float32
            and isinstance(randomness, torch.Tensor) and _compiling()):
        return _stochastic_round_bf16(x, randomness.view(x.shape))
    nearest = round_to(x, dtype)
    error = x - nearest.to(x.dtype)  # exact: nearest is within half an ulp of x (Sterbenz)
    bits = nearest.view(torch.int16)
    away_from_zero = (error > 0) == (nearest > 0)
    away_from_zero |= nearest == 0
    step = torch.where(away_from_zero, 1, -1).to(torch.int16)
    neighbour_bits = torch.where(nearest == 0, (error < 0).to(torch.int16) * -32768 | 1, bits + step)
    neighbour = neighbour_bits.view(dtype)
    spacing = (neighbour.to(x.dtype) - nearest.to(x.dtype)).abs()
    probability = error.abs() / spacing
    if isinstance(randomness, torch.Tensor):
        draw = randomness.view(x.shape)
    else:
        draw = torch.rand(x.shape, generator=randomness, device=x.device, dtype=torch.float32)
    take = (draw.to(x.dtype) < probability) & (error != 0) & torch.isfinite(spacing)
    return torch.where(take, neighbour, nearest)


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


def _stochastic_round_bf16(x: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """``stochastic_round(x, bfloat16, draw)`` for float32 ``x``, bit for bit, on the
    float32/int32 view (a bf16 value is a float32 whose low 16 bits are zero): inductor
    vectorizes this form on CPU, not the int16 one (a scalar loop, about 5x slower)."""
    nearest = x.to(torch.bfloat16).to(torch.float32)
    error = x - nearest  # exact
    finite = torch.isfinite(nearest)
    bits = torch.where(finite, nearest, 0.0).view(torch.int32)  # no int32 overflow below
    away_from_zero = ((error > 0) == (nearest > 0)) | (nearest == 0)
    step = away_from_zero.to(torch.int32) * 0x20000 - 0x10000  # +-1 bf16 ulp in magnitude
    tiny = (error < 0).to(torch.int32) * -0x80000000 + 0x10000  # +-smallest subnormal
    neighbour = torch.where(nearest == 0, tiny, bits + step).view(torch.float32)
    spacing = (neighbour - nearest).abs()
    probability = error.abs() / spacing
    take = (draw < probability) & (error != 0) & torch.isfinite(spacing) & finite
    return torch.where(take, neighbour, nearest).to(torch.bfloat16)


# split strategy: an fp32 master kept as (bf16 weight, 16 low bits).
#
#   fp32 master bits: [ sign | exponent(8) | mantissa(7) ][ mantissa low 16 ]
#                      \------------- T ---------------/  \------- L ------/
#
# The visible bf16 weight is T rounded to nearest by L, with ties (L == 0x8000) kept at T:
# that tie rule makes the encoding invertible, since L > 0x8000 <=> the weight was rounded up
# (one ulp away from zero: the integer view is sign-magnitude). We store L verbatim.
#
# A NaN master is the exception: its weight is T with the quiet bit set (0x0040: a NaN
# whatever T's payload), never rounded. Rounded as a number, T would show a number: 0x7FFF
# + 1 carries into the sign bit, a zero (CUDA's canonical NaN 0x7FFFFFFF gave -0.0), and
# 0x7F80 kept (a payload in the low half only) is inf. It decodes to a NaN (exponent all
# ones, mantissa at least 0x3F), not always its own bits: NaN payloads are not kept.
_LOW_MASK = 0xFFFF
_HALF = 0x8000
_QUIET = 0x0040  # bf16's quiet-NaN bit: the top mantissa bit


def split_encode(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split float32 ``master`` into (bf16 weight nearest to it, int16 low bits). Exact
    (``split_decode`` gives ``master``'s bits back) for every master but NaN; a NaN
    master's weight is a NaN and decodes to a NaN."""
    bits = master.view(torch.int32)
    top = bits >> 16  # arithmetic shift keeps the sign in the int32, masked below
    low = bits & _LOW_MASK
    nan = master.isnan()
    rounded_up = ((low > _HALF) & ~nan).to(torch.int32)
    weight_bits = torch.where(nan, top | _QUIET, top + rounded_up) & _LOW_MASK
    return _as_int16(weight_bits).view(torch.bfloat16), _as_int16(low)


def split_decode(weight: torch.Tensor, low_bits: torch.Tensor) -> torch.Tensor:
    """Rebuild the exact float32 master from ``split_encode``'s output."""
    low = low_bits.to(torch.int32) & _LOW_MASK
    rounded_up = (low > _HALF).to(torch.int32)
    top = (weight.view(torch.int16).to(torch.int32) & _LOW_MASK) - rounded_up
    return ((top << 16) | low).view(torch.float32)


def _as_int16(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int32 tensor (values 0..65535) as int16."""
    return torch.where(x >= _HALF, x - 0x10000, x).to(torch.int16)
