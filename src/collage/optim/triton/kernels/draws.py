"""The kernels' keyed uniforms (``draws.counter_uniform``) and stochastic rounding to bf16
(``rounding._stochastic_round_bf16``), bit for bit; ``stochastic_probe`` exposes the
rounding to the tests."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _bf16_bits, _finite, _widen
from .codes import C_INDEX, C_MIX


@triton.jit
def _mix64(h, value):
    """``draws.mix_state(h, value)``: one splitmix64 round on uint64 (wrapping)."""
    h = (h ^ value) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 31)) * 0x94D049BB133111EB
    return h ^ (h >> 29)


@triton.jit
def _mix32(x):
    """``draws._mix32`` (lowbias32) on uint32: wrapping multiplies, logical shifts."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_key(row_base, step):
    """The two 32-bit key words of ``draws.stochastic_key`` of a row's tensor at ``step``:
    scalars, computed once per tile (not per element) from the row's state after (seed,
    position) with one more splitmix64 round."""
    state = tl.load(row_base + C_MIX).to(tl.uint64, bitcast=True)
    key = _mix64(state, step.to(tl.uint64)) & 0x7FFFFFFFFFFFFFFF
    # stochastic_key's int32 words: (low 32 bits) - 2**31, and the next 31 bits
    key0 = (key & 0xFFFFFFFF).to(tl.uint32) ^ 0x80000000
    key1 = ((key >> 32) & 0x7FFFFFFF).to(tl.uint32)
    return key0, key1


@triton.jit
def _uniform(row_base, step, offs):
    """``draws.counter_uniform`` of the elements ``offs`` of the row's tensor at ``step``:
    two rounds of the 32-bit hash of the element's index in the whole tensor, keyed by
    :func:`_row_key`; 24 bits scaled to [0, 1) exactly."""
    key0, key1 = _row_key(row_base, step)
    index = (tl.load(row_base + C_INDEX) + offs).to(tl.uint32)
    h = _mix32(_mix32(index ^ key0) ^ key1)
    return ((h >> 8) & 0xFFFFFF).to(tl.float32) * (2.0**-24)


@triton.jit
def _power_of_two(exponent):
    """2**``exponent`` as float32, built from its bits (``exponent`` in [-126, 127])."""
    return ((exponent + 127) << 23).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _exponent_field(x):
    """The biased exponent field of float32 ``x``."""
    return ((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)


@triton.jit
def _over_spacing(error, spacing):
    """``|error| / spacing`` for a bf16 spacing (a power of two, 2**-133 ... 2**120), exactly
    as ``div_rn`` gives it, by exponent arithmetic instead of an IEEE division.

    k = -log2(spacing) comes from the exponent field; below 2**-126 the spacing is a
    float32 subnormal (bf16 values under 2**-119), whose field is 0, so it is read from
    ``spacing * 2**24`` instead (exact: a power of two, at least 2**-109). The quotient is
    ``|error|`` scaled by 2**k, done as two scalings by 2**(k >> 1) and 2**(k - (k >> 1)),
    each a normal float32 (|k| <= 133). Neither product overflows or underflows
    (``|error| < spacing``, and ``|error|``, a multiple of its float32 ulp, is at least
    2**-24 of ``spacing``'s binade above the subnormals), so each is exact, and so is the
    result, which is the exact quotient ``div_rn`` rounds to itself."""
    field = _exponent_field(spacing)
    k = tl.where(field == 0, 127 + 24 - _exponent_field(spacing * 16777216.0), 127 - field)
    half = k >> 1  # arithmetic shift: floor(k / 2)
    return (tl.abs(error) * _power_of_two(half)) * _power_of_two(k - half)


@triton.jit
def _stochastic_bf16(x, draw, HW: tl.constexpr):
    """``rounding._stochastic_round_bf16`` (``stochastic.h``: ``bf_stochastic``), bit for
    bit: the neighbour of the nearest bf16 on the other side of ``x`` with probability
    ``|x - nearest| / spacing``. Returns bf16 bits in a uint32."""
    nearest_bits = _bf16_bits(x, HW)
    nearest = _widen(nearest_bits)
    error = x - nearest  # exact (Sterbenz)
    finite = _finite(nearest)
    bits = tl.where(finite, nearest.to(tl.uint32, bitcast=True), 0)
    away = ((error > 0) == (nearest > 0)) | (nearest == 0)
    step = tl.where(away, 0x10000, 0xFFFF0000).to(tl.uint32)  # +-1 bf16 ulp in magnitude
    tiny = tl.where(error < 0, 0x80010000, 0x00010000).to(tl.uint32)  # +-smallest subnormal
    neighbour = tl.where(nearest == 0, tiny, bits + step).to(tl.float32, bitcast=True)
    spacing = tl.abs(neighbour - nearest)
    usable = (error != 0) & _finite(spacing) & finite
    probability = _over_spacing(tl.where(usable, error, 0.0), tl.where(usable, spacing, 1.0))
    take = (draw < probability) & usable
    return tl.where(take, neighbour.to(tl.uint32, bitcast=True) >> 16, nearest_bits)


@triton.jit
def stochastic_probe(x, draw, out, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    """``out = bf16 bits of stochastic rounding of x with draws``, elementwise by
    :func:`_stochastic_bf16`: the tests check its exponent arithmetic against an exact
    division at every bf16 spacing."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = _stochastic_bf16(tl.load(x + offs, mask=mask), tl.load(draw + offs, mask=mask), HW)
    tl.store(out + offs, bits.to(tl.uint16), mask=mask)
