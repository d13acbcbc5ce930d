"""The kernels' keyed uniforms (``draws.counter_uniform``) and stochastic rounding to bf16
(``rounding._stochastic_round_bf16``), bit for bit; ``stochastic_draw16_probe`` exposes the
rounding to the tests."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import C_INDEX, C_MIX


@triton.jit
def _mix64(h, value):
    """``draws.mix_state(h, value)``: one splitmix64 round on uint64 (wrapping)."""
    h = (h ^ value) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 31)) * 0x94D049BB133111EB
    return h ^ (h >> 29)


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
def _draw16(row_base, step, offs):
    """The top 16 bits ``u >> 8`` of the 24-bit draws ``u`` of ``draws.counter_uniform``
    (the uniform is ``u * 2**-24``; ``u = (h >> 8) & 0xFFFFFF`` with ``h =
    _mix32(_mix32(index ^ key0) ^ key1)``, ``draws._mix32`` lowbias32), keyed by
    :func:`_row_key`, as uint32: that hash in fewer operations, each step an identity
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
def _stochastic_bf16_draw16(x, high):
    """``rounding._stochastic_round_bf16`` (``stochastic.h``: ``bf_stochastic``: the
    neighbour of the nearest bf16 on the other side of ``x`` with probability ``|x -
    nearest| / spacing``) for a draw on the 2**-24 grid (``draw = u * 2**-24``, every draw
    of the step: :func:`_draw16`), from ``high = u >> 8``, the same bits, on the integer
    view alone. With ``top`` and ``low`` the bit pattern's halves (``top`` the bf16
    value toward zero, ``low`` how far past it ``x`` is, in 2**-16 of the bf16 spacing
    there, which is also the spacing to the next bf16 away from zero, subnormals and the
    binade's edges included), the nearest is ``top`` or ``top + 1`` (in magnitude) and the
    other side of ``x`` the other one; the probability of taking it is ``low / 2**16``
    rounding down and ``(2**16 - low) / 2**16`` rounding up, and ``u * 2**-24 < k / 2**16``
    is ``high < k`` for an integer ``k``. So the result is ``top + 1`` exactly when
    ``low + (high, rounding up; 0xFFFF - high, rounding down)`` carries into ``top``.
    Where ``x`` is exact (``low == 0``) nothing carries; where the step away from zero is
    inf (``top``'s magnitude 0x7F7F) the reference keeps the nearest; NaN stays 0xFFFF
    (``arithmetic._bf16_bits``). Returns bf16 bits in a uint32: a dozen integer operations
    instead of the exponent arithmetic of the float form it replaced (issue #44;
    ``stochastic_draw16_probe``)."""
    bits = x.to(tl.uint32, bitcast=True)
    top = bits >> 16
    up = ((bits + 0x7FFF + (top & 1)) >> 16) != top  # the nearest is top + 1 (ties to even)
    add = tl.where(up, high, high ^ 0xFFFF)
    out = (bits + add) >> 16
    out = tl.where((top & 0x7FFF) == 0x7F7F, top + up.to(tl.uint32), out)
    return tl.where(x != x, 0xFFFF, out)


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
