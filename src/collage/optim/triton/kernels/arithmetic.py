"""Exact float32 arithmetic in Triton: a fused multiply-add rounded once (emulated in the
interpreter), torch's ``lerp``, and float32 -> bf16 rounding to nearest on the bit pattern
(the package docstring says why each is the operation torch rounds)."""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import BF16


@triton.jit
def _fma_emulated(a, b, c):
    """fma(a, b, c) of float32 values, correctly rounded, from float64 operations.

    The product of two 24-bit significands is exact in float64 (48 <= 53 bits). The sum
    ``s = p + c`` is rounded and TwoSum recovers its error ``e`` exactly (``s + e == p +
    c``). Rounding ``p + c`` to odd at 53 bits (the truncation with the sticky bit or-ed in:
    ``s`` itself when exact or odd, else its neighbour towards ``e``, which is odd) and
    then to nearest at 24 bits is the correct rounding, since 53 >= 24 + 2 (Boldo and
    Melquiond, round-to-odd). Non-finite sums are left as they are."""
    p = a.to(tl.float64) * b.to(tl.float64)
    z = c.to(tl.float64)
    s = p + z
    bb = s - p
    e = (p - (s - bb)) + (z - bb)
    bits = s.to(tl.int64, bitcast=True)
    finite = (bits & 0x7FF0000000000000) != 0x7FF0000000000000
    even = (bits & 1) == 0
    # a nonzero e means s != 0; the sign-magnitude view moves |s| by one ulp with +-1
    outward = (e > 0) == (s > 0)
    moved = tl.where(outward, bits + 1, bits - 1)
    odd = tl.where((e != 0) & even & finite, moved, bits)
    return odd.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _fma(a, b, c, EMULATE_FMA: tl.constexpr):
    """``a * b + c`` rounded once (torch's lerp, add(alpha=) and addcmul on CPU and CUDA)."""
    if EMULATE_FMA:
        return _fma_emulated(a, b, c)
    else:
        return tl.fma(a, b, c)


@triton.jit
def fma_probe(a, b, c, out, n, EMULATE_FMA: tl.constexpr, BLOCK: tl.constexpr):
    """``out = fma(a, b, c)`` elementwise by :func:`_fma`: the tests check it against
    torch's fused multiply-add (``addcmul``), emulated and in hardware."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _fma(tl.load(a + offs, mask=mask), tl.load(b + offs, mask=mask),
             tl.load(c + offs, mask=mask), EMULATE_FMA)
    tl.store(out + offs, x, mask=mask)


@triton.jit
def _lerp(a, b, w, EMULATE_FMA: tl.constexpr):
    """torch's ``a.lerp(b, w)`` for a scalar weight: ``a + w (b - a)`` for ``|w| < 0.5``,
    else ``b - (1 - w)(b - a)``, each one fused multiply-add."""
    d = b - a
    wide = tl.broadcast_to(w, d.shape)
    small = _fma(wide, d, a, EMULATE_FMA)
    large = _fma(wide - 1.0, d, b, EMULATE_FMA)
    return tl.where(tl.abs(w) < 0.5, small, large)


@triton.jit
def _axpy(base, update, scale, HAS_SCALE: tl.constexpr, EMULATE_FMA: tl.constexpr):
    """``strategy.axpy``: ``base + update * scale`` rounded once (``scale`` None: plain add)."""
    if HAS_SCALE:
        return _fma(update, tl.broadcast_to(scale, update.shape), base, EMULATE_FMA)
    else:
        return base + update


@triton.jit
def _div_by_row(x, c, reciprocal, EMULATE_FMA: tl.constexpr):
    """``x / c`` correctly rounded (the bits of ``tl.div_rn(x, c)``) for a per-row constant
    ``c`` whose reciprocal, rounded to nearest, is computed once a tile: a multiply and two
    fused multiply-adds an element instead of a division's approximate reciprocal, its
    refinement and its range check (``FCHK`` and a branch; issue #44).

    The C kernels' division by the bias correction (``rounding.h``: ``v_over_bc2s``), the
    same operations: ``q = RN(x * r)`` with ``r = RN(1 / c)``, corrected once, ``RN(q -
    RN(q * c - x) * r)`` (Markstein's correction; the residual ``q * c - x`` is exact).
    The corrected quotient is the IEEE one for every dividend significand of the 1,000,000
    divisor significands whose reciprocals are the worst rounded (checked offline,
    ``benchmarks/studies/division_search.c``; docs/strategies.md): a tested result for
    those divisors, not a proof for every one. Its domain, which AdamW's ``sqrt(v) / c3``
    keeps: ``c`` in ``(0, 1]`` and ``x`` a square root, never subnormal, so that the
    quotient neither overflows nor underflows. That form keeps a zero's sign (``-0``: the
    residual is ``+0``, ``-0 - +0 * r = -0``); an infinite or NaN ``x``, which the
    correction would turn into NaN, is passed through, as the division passes it."""
    q = x * reciprocal
    residual = _fma(q, c, -x, EMULATE_FMA)
    corrected = _fma(-residual, reciprocal, q, EMULATE_FMA)
    return tl.where(tl.abs(x) < float("inf"), corrected, x)


@triton.jit
def div_by_row_probe(x, c, out, n, EMULATE_FMA: tl.constexpr, BLOCK: tl.constexpr):
    """``out = x / c`` elementwise by :func:`_div_by_row` with the reciprocal of each
    element's ``c`` (the tests check it against IEEE division)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    divisor = tl.load(c + offs, mask=mask, other=1.0)
    quotient = _div_by_row(tl.load(x + offs, mask=mask), divisor, tl.div_rn(1.0, divisor),
                           EMULATE_FMA)
    tl.store(out + offs, quotient, mask=mask)


@triton.jit
def _finite(x):
    """Whether float32 ``x`` is finite (exponent not all ones)."""
    return (x.to(tl.uint32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _bf16_bits(x, HW: tl.constexpr):
    """float32 -> bf16 bits (in a uint32): nearest, ties to even; NaN -> 0xFFFF, as ATen's
    CPU conversion (``rounding.h``: ``bf_round``).

    ``HW`` (a GPU): the hardware conversion (``cvt.rn.bf16.f32``, one F2FP for two values),
    which rounds to nearest even as well (PTX ISA, ``.rn``); only NaN's pattern differs, so
    NaN is set apart. Otherwise (the interpreter, whose conversion does not round to
    nearest) on the integer view: adding 0x7FFF plus the kept part's lowest bit carries into
    the kept part exactly when the dropped half is above a tie, or a tie with an odd kept
    part."""
    if HW:
        bits = x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        u = x.to(tl.uint32, bitcast=True)
        bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0xFFFF, bits)


@triton.jit
def _widen(bits):
    """bf16 bits (in a uint32) -> float32, exactly."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round(x, KIND: tl.constexpr, HW: tl.constexpr):
    """``x`` rounded to nearest in a 16-bit column's dtype, back in float32 (the value a
    stored component holds; a NaN stays a NaN, its pattern is set when stored)."""
    if KIND == BF16:
        if HW:
            return x.to(tl.bfloat16).to(tl.float32)
        else:
            return _widen(_bf16_bits(x, HW))
    else:
        return x.to(tl.float16).to(tl.float32)
