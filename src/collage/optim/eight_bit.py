"""8-bit optimizer states for the ``plus8`` strategy: block-scaled float8 codes, rounded
stochastically so that every EMA increment lands on average.

Two formats, both over blocks of ``BLOCK`` consecutive elements (of the flattened tensor)
sharing a float32 power-of-two scale ``s`` (``collage.mcf.blocks``), which maps the block's
largest magnitude into the top binade below the format's maximum, with room for a
rounding carry (e4m3fn: ``[2**7, 2**8)``, max 448; e5m2: ``[2**14, 2**15)``, max 57344):

* **q8** (Adam's first moment, 1 byte): ``x = s * c`` with ``c`` a ``float8_e4m3fn`` code.
  ``x / s`` is rounded *stochastically* to the e4m3 grid: up to the next grid point with
  probability equal to the distance from the lower one over the spacing. Unbiased.

* **pair11** (Adam's second moment, 2 bytes, non-negative values): ``x = s * (h + l * u(h))``
  with ``h`` a ``float8_e5m2`` code, ``l`` a ``uint8`` in ``[0, 255]`` and ``u(h)`` the e5m2
  spacing at ``h`` divided by 256::

      x / s = h + l * u(h):   h  = e5m2 code, x/s truncated to 3 significant bits
                              l  = the next 8 bits (a fixed-point fraction of h's spacing)

  So a pair is a float with 11 significant bits and e5m2's exponent range; ``x / s`` is
  rounded stochastically to that 11-bit grid, then split *exactly* (h: truncation to the
  e5m2 grid; l: the remainder, an integer number of ``u(h)``). A carry that reaches the next
  e5m2 value gives ``l = 0``, so no ``l`` ever overflows. A plain float8 pair cannot do
  this: its ``lo`` is rounded relative to itself and leaves only ~2p significant bits.

Why e5m2 under v and e4m3 under m: Adam divides m by sqrt(v), so v's format must reach
as far below its block's maximum as m's does, squared. q8 resolves ``2**-17`` of its block
maximum (e4m3's smallest subnormal over ``2**8``); pair11 resolves ``2**-39`` of v's block
maximum (e5m2's ``2**-16`` over 256, over ``2**15``), i.e. ``2**-19.5`` in gradient terms. An
e4m3 pair (12 bits but only ``2**-25`` of the block, ``2**-12.5`` in gradient terms) rounds
v to zero where m is still resolved, and ``m / (0 + eps)`` is a huge step. After a gradient
spike v's block maximum decays 100 times more slowly than m's, and a neighbour's v falls
below even pair11's range: so a positive x is never stored below pair11's smallest value
(``2**-24 * s``), on both encoders; a spike damps its block instead of throwing it
(docs/eight_bit.md, limitations).

Why stochastic: an EMA ``v <- v + (1 - beta) (x - v)`` with beta = 0.999 adds
``0.001 (x - v)``. Rounded to nearest, that is lost whenever it is below half a spacing:
for a float8 code (spacing 6-25% of v) unless ``|x - v| > 30 v``, i.e. almost always; for
the 11-bit pair once ``|x - v| < 0.25-0.5 v``: the EMA stalls short of its target. Stochastic
rounding lands each increment in expectation; the EMA itself averages the rounding noise
(its variance is damped by ``1 / (1 - beta**2)``; ``docs/eight_bit.md`` has the numbers).

Non-finite rule: a non-finite value (or a negative one in pair11) encodes as nan (``h``
nan, ``l`` 0), like ``collage.mcf.round_to`` does for e4m3fn overflow; it does not affect
its block's scale. Subnormal codes are used as is: below ``2**-6 * s`` (e4m3) the spacing
is fixed (``2**-9 * s``; pair11: ``2**-24 * s`` below ``2**-14 * s``), and stochastic
rounding still keeps the mean, except under pair11's smallest value (above).

Each format has a float32 implementation (integer bit operations, compiles inside the fused
kernels) and a float64 reference written from the definition (``frexp``, ``floor``); given
the same uniforms they agree bit for bit on float32 input (``tests/optim/test_eight_bit.py``).
Uniforms are float32 on a 2**-24 grid (``draws.counter_uniform``): the
rounding probability is then exact whenever the distance is a multiple of 2**-24 of the
spacing, which holds for every float32 input above the formats' subnormal ranges (the grid
has at most 11 significant bits); in q8's the spacing is fixed and a tiny value is stored
too large on average (docs/eight_bit.md).
"""

from __future__ import annotations

import torch

from ..mcf.blocks import (
    block_scales,
    block_scales_reference,
    expand_scales,
    exponent32,
    pow2_32,
)

__all__ = [
    "BLOCK",
    "CODE_DTYPE",
    "HI_DTYPE",
    "LO_DTYPE",
    "n_blocks",
    "encode_q8",
    "decode_q8",
    "encode_pair11",
    "decode_pair11",
    "encode_q8_reference",
    "encode_pair11_reference",
    "decode_q8_reference",
    "decode_pair11_reference",
]

BLOCK = 128
CODE_DTYPE = torch.float8_e4m3fn  # q8 codes
HI_DTYPE = torch.float8_e5m2  # pair11 leading codes
LO_DTYPE = torch.uint8  # pair11 trailing bits
# (fraction bits, smallest normal exponent, binade of the block maximum) per format
_E4M3 = (3, -6, 7)
_E5M2 = (2, -14, 14)
_LO_BITS = 8
# pair11's smallest positive value over its block scale: one unit of l under h = 0
# (e5m2's smallest subnormal 2**-16, over 2**8). A positive v is never stored below it.
_SMALLEST_PAIR11 = 2.0 ** (_E5M2[1] - _E5M2[0] - _LO_BITS)


def n_blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


# ------------------------------------------------------------------ float32 (fast, compiled)


def _spacing32(mag: torch.Tensor, fmt, extra_bits: int) -> torch.Tensor:
    """The spacing of format ``fmt`` at ``mag >= 0`` (its binade by truncation), divided by
    ``2**extra_bits``; float32, a power of two."""
    mantissa, min_exp, _ = fmt
    e = exponent32(mag).clamp(min=min_exp)
    return pow2_32(e - mantissa - extra_bits)


def _stochastic_grid32(mag: torch.Tensor, spacing: torch.Tensor, u: torch.Tensor):
    """``mag`` rounded to a multiple of ``spacing``: up with probability ``frac``. Exact:
    division by a power of two, floor and the final product are exact in float32."""
    q = mag / spacing
    low = torch.floor(q)
    return (low + (u < q - low).to(mag.dtype)) * spacing


def encode_q8(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` -> (e4m3fn codes, float32 block scales); ``u``: one uniform per element."""
    flat = x.reshape(-1)
    scales = block_scales(flat, BLOCK, _E4M3[2])
    y = flat / expand_scales(scales, flat.numel(), BLOCK)
    mag = y.abs()
    finite = torch.isfinite(mag)
    mag = torch.where(finite, mag, torch.zeros_like(mag))
    rounded = _stochastic_grid32(mag, _spacing32(mag, _E4M3, 0), u.reshape(-1))
    code = torch.where(finite, torch.copysign(rounded, y), torch.full_like(y, float("nan")))
    return code.to(CODE_DTYPE).view(x.shape), scales


def decode_q8(code: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 value of q8 codes (exact: a 4-bit code times a power of two)."""
    flat = code.reshape(-1).float()
    return (flat * expand_scales(scales, flat.numel(), BLOCK)).view(code.shape)


def encode_pair11(x: torch.Tensor, u: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``x >= 0`` -> (e5m2 ``h``, uint8 ``l``, float32 block scales)."""
    flat = x.reshape(-1)
    scales = block_scales(flat, BLOCK, _E5M2[2])
    y = flat / expand_scales(scales, flat.numel(), BLOCK)
    valid = torch.isfinite(y) & (y >= 0)
    y = torch.where(valid, y, torch.zeros_like(y))
    value = _stochastic_grid32(y, _spacing32(y, _E5M2, _LO_BITS), u.reshape(-1))  # 11 bits
    value = torch.where(valid & (flat > 0), value.clamp(min=_SMALLEST_PAIR11), value)
    spacing = _spacing32(value, _E5M2, 0)  # of value's binade: a carry to 2**k gives l = 0
    hi = torch.floor(value / spacing) * spacing
    lo = (value - hi) / spacing * (1 << _LO_BITS)  # exact integer in [0, 255]
    hi = torch.where(valid, hi, torch.full_like(hi, float("nan")))
    lo = torch.where(valid, lo, torch.zeros_like(lo))
    return hi.to(HI_DTYPE).view(x.shape), lo.to(LO_DTYPE).view(x.shape), scales


def decode_pair11(hi: torch.Tensor, lo: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 value of a pair11 (exact: 11 significant bits times a power of two)."""
    h = hi.reshape(-1).float()
    fine = _spacing32(torch.where(torch.isfinite(h), h, torch.zeros_like(h)), _E5M2, _LO_BITS)
    value = h + lo.reshape(-1).float() * fine
    return (value * expand_scales(scales, h.numel(), BLOCK)).view(hi.shape)


# ------------------------------------------------------------------ float64 reference


def _spacing64(mag: torch.Tensor, fmt, extra_bits: int) -> torch.Tensor:
    mantissa, min_exp, _ = fmt
    _, e = torch.frexp(mag)  # mag = m * 2**e, 0.5 <= m < 1 (e = 0 for mag = 0)
    e = torch.where(mag > 0, e.double() - 1, torch.full_like(mag, float(min_exp)))
    return torch.exp2(e.clamp(min=min_exp) - mantissa - extra_bits)


def _scaled_reference(x: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1).double()
    scales = block_scales_reference(flat, BLOCK, fmt[2])
    return flat / expand_scales(scales, flat.numel(), BLOCK), scales


def _round_up(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """floor(q) + 1 with probability q - floor(q), for uniforms ``u``."""
    low = torch.floor(q)
    return low + (u.double() < q - low).double()


def encode_q8_reference(x: torch.Tensor, u: torch.Tensor):
    """:func:`encode_q8` from its definition (float64; returns float64 values: the rounded
    ``x / s`` and the scales)."""
    y, scales = _scaled_reference(x, _E4M3)
    finite = torch.isfinite(y)
    mag = torch.where(finite, y.abs(), torch.zeros_like(y))
    spacing = _spacing64(mag, _E4M3, 0)
    rounded = torch.copysign(_round_up(mag / spacing, u.reshape(-1)) * spacing, y)
    return torch.where(finite, rounded, torch.full_like(y, float("nan"))), scales


def encode_pair11_reference(x: torch.Tensor, u: torch.Tensor):
    """:func:`encode_pair11` from its definition (float64): (h, l, scales)."""
    y, scales = _scaled_reference(x, _E5M2)
    valid = torch.isfinite(y) & (y >= 0)
    y = torch.where(valid, y, torch.zeros_like(y))
    fine = _spacing64(y, _E5M2, _LO_BITS)
    value = _round_up(y / fine, u.reshape(-1)) * fine
    positive = valid & (x.reshape(-1) > 0)
    value = torch.where(positive, value.clamp(min=_SMALLEST_PAIR11), value)
    spacing = _spacing64(value, _E5M2, 0)
    hi = torch.floor(value / spacing) * spacing
    lo = (value - hi) / spacing * 2**_LO_BITS
    hi = torch.where(valid, hi, torch.full_like(hi, float("nan")))
    return hi, torch.where(valid, lo, torch.zeros_like(lo)), scales


def decode_q8_reference(code: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    flat = code.reshape(-1).double()
    return (flat * expand_scales(scales.double(), flat.numel(), BLOCK)).view(code.shape)


def decode_pair11_reference(hi: torch.Tensor, lo: torch.Tensor, scales: torch.Tensor):
    h = hi.reshape(-1).double()
    fine = _spacing64(torch.where(torch.isfinite(h), h.abs(), torch.zeros_like(h)), _E5M2,
                      _LO_BITS)
    value = h + lo.reshape(-1).double() * fine
    return (value * expand_scales(scales.double(), h.numel(), BLOCK)).view(hi.shape)
