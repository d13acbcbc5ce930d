"""The kernels' keyed uniforms (``draws.counter_uniform``) and stochastic rounding to bf16
(``rounding._stochastic_round_bf16``), bit for bit; ``stochastic_probe`` and
``stochastic_draw16_probe`` expose the rounding to the tests."""

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
def _draw16(row_base, step, offs):
    """The top 16 bits ``u >> 8`` of :func:`_uniform`'s 24-bit draws ``u`` (the uniform is
    ``u * 2**-24``), as uint32: the same hash in fewer operations, each step an identity
    of the logical shift (``(a ^ b) >> k == (a >> k) ^ (b >> k)``; ``h ^ (h >> 16)``
    leaves ``h``'s top 16 bits as they are):

    * the first round's ``v ^ (v >> 16)`` of ``v = index ^ key0`` is ``index ^ (index >>
      16)`` xor the tile's constant ``key0 ^ (key0 >> 16)``;
    * the first round's last ``h ^ (h >> 16)``, the xor with ``key1`` and the second
      round's first ``v ^ (v >> 16)``: the two shifts of ``h`` cancel, leaving ``h`` xor
      the constant ``key1 ^ (key1 >> 16)``;
    * ``u >> 8 == (h >> 8) >> 8`` is the top 16 bits of the second round's ``h``, which
      its last ``h ^ (h >> 16)`` does not change: that step and the float conversion go.

    :func:`_stochastic_bf16_draw16` needs no more of the draw (issue #44: with it, the
    stochastic loop's 1,067 instructions per tile -> 822)."""
    key0, key1 = _row_key(row_base, step)
    index = (tl.load(row_base + C_INDEX) + offs).to(tl.uint32)
    x = (index ^ (index >> 16)) ^ (key0 ^ (key0 >> 16))
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (key1 ^ (key1 >> 16))
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x >> 16


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
def _stochastic_bf16_draw16(x, high):
    """:func:`_stochastic_bf16` for a draw on the 2**-24 grid (``draw = u * 2**-24``, every
    draw of the step: :func:`_uniform`), from ``high = u >> 8``, the same bits, on the
    integer view alone. With ``top`` and ``low`` the bit pattern's halves (``top`` the bf16
    value toward zero, ``low`` how far past it ``x`` is, in 2**-16 of the bf16 spacing
    there, which is also the spacing to the next bf16 away from zero, subnormals and the
    binade's edges included), the nearest is ``top`` or ``top + 1`` (in magnitude) and the
    other side of ``x`` the other one; the probability of taking it is ``low / 2**16``
    rounding down and ``(2**16 - low) / 2**16`` rounding up, and ``u * 2**-24 < k / 2**16``
    is ``high < k`` for an integer ``k``. So the result is ``top + 1`` exactly when
    ``low + (high, rounding up; 0xFFFF - high, rounding down)`` carries into ``top``.
    Where ``x`` is exact (``low == 0``) nothing carries; where the step away from zero is
    inf (``top``'s magnitude 0x7F7F) the reference keeps the nearest; NaN stays 0xFFFF
    (:func:`_bf16_bits`). Returns bf16 bits in a uint32: a dozen integer operations instead
    of :func:`_stochastic_bf16`'s exponent arithmetic (issue #44;
    ``stochastic_draw16_probe``)."""
    bits = x.to(tl.uint32, bitcast=True)
    top = bits >> 16
    up = ((bits + 0x7FFF + (top & 1)) >> 16) != top  # the nearest is top + 1 (ties to even)
    add = tl.where(up, high, high ^ 0xFFFF)
    out = (bits + add) >> 16
    out = tl.where((top & 0x7FFF) == 0x7F7F, top + up.to(tl.uint32), out)
    return tl.where(x != x, 0xFFFF, out)


@triton.jit
def stochastic_probe(x, draw, out, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    """``out = bf16 bits of stochastic rounding of x with draws``, elementwise by
    :func:`_stochastic_bf16`: the tests check its exponent arithmetic against an exact
    division at every bf16 spacing."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = _stochastic_bf16(tl.load(x + offs, mask=mask), tl.load(draw + offs, mask=mask), HW)
    tl.store(out + offs, bits.to(tl.uint16), mask=mask)


@triton.jit
def stochastic_draw16_probe(x, draw, out, n, BLOCK: tl.constexpr):
    """``out = bf16 bits of stochastic rounding of x with draws`` (draws on the 2**-24
    grid), elementwise by :func:`_stochastic_bf16_draw16`: the tests check it against
    ``rounding._stochastic_round_bf16``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = (tl.load(draw + offs, mask=mask) * 16777216.0).to(tl.uint32)
    bits = _stochastic_bf16_draw16(tl.load(x + offs, mask=mask), u >> 8)
    tl.store(out + offs, bits.to(tl.uint16), mask=mask)
