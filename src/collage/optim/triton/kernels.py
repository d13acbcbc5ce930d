"""The Triton kernels: one multi-tensor step of AdamW, SGD or Lion under a precision
strategy, ``kernels.fast_step``'s float32 arithmetic operation for operation.

This module is loaded by ``launch.py`` (``launch.kernel_module``) once per mode, compiled
for a GPU or interpreted on CPU (``TRITON_INTERPRET=1``): ``@triton.jit`` reads the mode
when it decorates. It needs Triton; nothing else in collage imports it. It calls Triton's
builtins only (``tl.full``, not ``tl.zeros_like``): the ``@jit`` helpers of
``triton.language.standard`` were decorated in the mode of the process's import of Triton,
and a compiled one cannot run in the interpreted copy of this module.

One launch steps many tensors. Tile ``i`` is ``blocks[i] = (row, block)``: elements
``block * BLOCK ...`` of the tensor of ``table[row]`` (``layout``: the addresses of its
components, its size, its draws' counter). Persistent programs walk the tiles, fetching the
next before computing the current (:func:`multi_tensor_step`). Every stored component is
read once and written once, in its own dtype, in one pass, in 16-byte vectors where the host
proved the alignment (:func:`_pointer`); the gradient is read in its dtype and unscaled and
negated in registers. With ``SKIPPABLE`` the kernel reads the non-finite check's verdict on
the device and, when it is set, writes nothing.

Exact where the operations are the same (``docs/gpu.md``): each float32 operation is the
one the eager path rounds, in its order, correctly rounded:

* division and square root are ``tl.div_rn`` and ``tl.sqrt_rn`` (IEEE). Triton's ``/`` and
  ``tl.sqrt`` are approximate on NVIDIA GPUs (``div.full.f32``, ``sqrt.approx.f32``: up to
  2 ulp), which torch's kernels, on CPU and CUDA, are not;
* a multiply and an add that torch rounds separately stay separate: the launch turns
  Triton's contraction into fused multiply-adds off (``enable_fp_fusion=False``), and the
  fused multiply-adds torch does compute (``lerp``, ``add(alpha=)``, ``addcmul``) are explicit
  (:func:`_fma`). The interpreter's ``tl.fma`` rounds twice (numpy ``x * y + z``), so there
  :func:`_fma` computes the correctly rounded result in float64 (``EMULATE_FMA``);
* float32 -> bf16 rounds to nearest, ties to even: on a GPU by the hardware conversion
  (``HW``), in the interpreter, whose conversion does not, on the bit pattern
  (``rounding.h``'s ``bf_round``); NaN is stored as 0xFFFF either way (:func:`_bf16_bits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import layout

# Triton reads globals only as constexprs: layout.py's numbers, wrapped
F32: tl.constexpr = tl.constexpr(layout.KINDS[torch.float32])
BF16: tl.constexpr = tl.constexpr(layout.KINDS[torch.bfloat16])
F16: tl.constexpr = tl.constexpr(layout.KINDS[torch.float16])
ADAMW: tl.constexpr = tl.constexpr(layout.RULE_CODES["adamw"])
SGD: tl.constexpr = tl.constexpr(layout.RULE_CODES["sgd"])
LION: tl.constexpr = tl.constexpr(layout.RULE_CODES["lion"])
# landings: the strategies' ``native_code`` (the C kernels' numbers, ``native/native.h``)
L_FP32: tl.constexpr = tl.constexpr(0)
L_MIXED: tl.constexpr = tl.constexpr(1)
L_BF16: tl.constexpr = tl.constexpr(2)
L_KAHAN: tl.constexpr = tl.constexpr(3)
L_STOCHASTIC: tl.constexpr = tl.constexpr(4)
L_LIGHT: tl.constexpr = tl.constexpr(5)
L_PLUS: tl.constexpr = tl.constexpr(6)
L_SPLIT: tl.constexpr = tl.constexpr(7)
NCOL: tl.constexpr = tl.constexpr(layout.NCOL)
C_PARAM: tl.constexpr = tl.constexpr(layout.C_PARAM)
C_EXTRA: tl.constexpr = tl.constexpr(layout.C_EXTRA)
C_STATE: tl.constexpr = tl.constexpr(layout.C_STATE)
C_NUMEL: tl.constexpr = tl.constexpr(layout.C_NUMEL)
C_INDEX: tl.constexpr = tl.constexpr(layout.C_INDEX)
C_MIX: tl.constexpr = tl.constexpr(layout.C_MIX)
C_STEP: tl.constexpr = tl.constexpr(layout.C_STEP)
NCOEF: tl.constexpr = tl.constexpr(layout.NCOEF)


# ---------------------------------------------------------------------------------------
# exact arithmetic helpers
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# columns: typed addresses, raw loads, values, stores
# ---------------------------------------------------------------------------------------


@triton.jit
def _pointer(cell, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """The column whose int64 address is in ``cell``, as a pointer to its elements (bf16
    and split's int16 as their 16 bits). ``ALIGNED``: the host checked the address is a
    multiple of 16 bytes. The hint goes on the pointer, after the cast (a hint on the
    integer does not survive it): with it the compiler loads and stores a thread's 8
    16-bit (or 4 float32) elements as one 16-byte vector."""
    address = tl.load(cell)
    if KIND == F32:
        pointer = address.to(tl.pointer_type(tl.float32))
    elif KIND == F16:
        pointer = address.to(tl.pointer_type(tl.float16))
    else:
        pointer = address.to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _raw(pointer, offs, mask):
    """Elements ``offs`` of a column as stored (0 where masked)."""
    return tl.load(pointer + offs, mask=mask, other=0)


@triton.jit
def _value(raw, KIND: tl.constexpr):
    """A raw column tile as float32, exactly."""
    if KIND == BF16:
        return _widen(raw.to(tl.uint32))
    else:
        return raw.to(tl.float32)


@triton.jit
def _store(pointer, offs, x, mask, KIND: tl.constexpr, HW: tl.constexpr):
    """Store float32 ``x`` rounded to nearest into the column (float32: as is)."""
    if KIND == F32:
        tl.store(pointer + offs, x, mask=mask)
    elif KIND == BF16:
        tl.store(pointer + offs, _bf16_bits(x, HW).to(tl.uint16), mask=mask)
    else:
        tl.store(pointer + offs, x.to(tl.float16), mask=mask)


@triton.jit
def _normalize(hi, lo, HI_KIND: tl.constexpr, LO_KIND: tl.constexpr, HW: tl.constexpr):
    """``strategy.normalize_pair`` on stored values (float32 holding them): ``hi`` the
    nearest (ties to even) of ``hi + lo``, ``lo`` the exact rest; +0 where ``hi`` is not
    finite. ``hi + lo`` and the rest are exact in float32."""
    total = hi + lo
    nearest = _round(total, HI_KIND, HW)
    return nearest, _round(tl.where(_finite(nearest), total - nearest, 0.0), LO_KIND, HW)


@triton.jit
def _store_pair(hi_pointer, lo_pointer, offs, x, mask, KIND: tl.constexpr,
                HW: tl.constexpr):
    """Store float32 ``x`` as an MCF pair: ``hi`` its nearest value, ``lo`` the residual
    ``x - hi`` (exact in float32: Sterbenz), rounded, +0 where ``hi`` is not finite
    (``strategy.residual``); then normalised (the canonical form)."""
    hi = _round(x, KIND, HW)
    lo = _round(tl.where(_finite(hi), x - hi, 0.0), KIND, HW)
    hi, lo = _normalize(hi, lo, KIND, KIND, HW)
    _store(hi_pointer, offs, hi, mask, KIND, HW)
    _store(lo_pointer, offs, lo, mask, KIND, HW)


@triton.jit
def _store_state(hi_pointer, lo_pointer, offs, x, mask, KIND: tl.constexpr,
                 PAIR: tl.constexpr, HW: tl.constexpr):
    """Store a rule state: one column, or a pair (``hi_pointer``, ``lo_pointer``)."""
    if PAIR:
        _store_pair(hi_pointer, lo_pointer, offs, x, mask, KIND, HW)
    else:
        _store(hi_pointer, offs, x, mask, KIND, HW)


# ---------------------------------------------------------------------------------------
# draws (``draws.counter_uniform``) and stochastic rounding
# ---------------------------------------------------------------------------------------


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
    """``rounding._stochastic_round_bf16`` (``rounding.h``: ``bf_stochastic``), bit for
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


# ---------------------------------------------------------------------------------------
# a tile: where it is, and its columns as stored
# ---------------------------------------------------------------------------------------


@triton.jit
def _unused(BLOCK: tl.constexpr):
    """A column a variant does not read (a constant: no load)."""
    return tl.full([BLOCK], 0, tl.uint16)


@triton.jit
def _fetch_state(row_base, column: tl.constexpr, USED: tl.constexpr, offs, mask,
                 KIND: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """A state column's pointer and raw tile, or placeholders where unused."""
    if USED:
        pointer = _pointer(row_base + column, KIND, ALIGNED)
        return pointer, _raw(pointer, offs, mask)
    else:
        return row_base.to(tl.pointer_type(tl.uint16)), _unused(BLOCK)


@triton.jit
def _fetch(table, grads, blocks, i, RULE: tl.constexpr, LANDING: tl.constexpr,
           W_KIND: tl.constexpr, X_KIND: tl.constexpr, S_KIND: tl.constexpr,
           SLOW_PAIR: tl.constexpr, MOMENTUM: tl.constexpr, MASKED: tl.constexpr,
           ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``i`` of the launch: its row, elements and every column it reads, loaded as
    stored (the loads issued, their values used later: :func:`multi_tensor_step` fetches
    the next tile before it computes this one)."""
    row = tl.load(blocks + 2 * i).to(tl.int64)
    block = tl.load(blocks + 2 * i + 1).to(tl.int64)
    row_base = table + row * NCOL
    offs = block * BLOCK + tl.arange(0, BLOCK)
    # A size loaded from memory has no known divisibility, so a mask built from it varies
    # element by element and forbids vector loads: whole blocks run unmasked, in their own
    # loop, and only the tails compare
    if MASKED:
        mask = offs < tl.load(row_base + C_NUMEL)
    else:
        mask = tl.full([BLOCK], True, tl.int1)
    g_ptr = _pointer(grads + row, W_KIND, ALIGNED)
    g = _raw(g_ptr, offs, mask)
    # the weight's columns: mixed reads its float32 master only
    if LANDING == L_MIXED:
        w_ptr = _pointer(row_base + C_PARAM, W_KIND, ALIGNED)
        w = _unused(BLOCK)
        x_ptr = _pointer(row_base + C_EXTRA, F32, ALIGNED)
    else:
        w_ptr = _pointer(row_base + C_PARAM, W_KIND, ALIGNED)
        w = _raw(w_ptr, offs, mask)
        x_ptr = _pointer(row_base + C_EXTRA, X_KIND, ALIGNED)
    if LANDING == L_MIXED or LANDING == L_LIGHT or LANDING == L_PLUS or \
            LANDING == L_SPLIT or LANDING == L_KAHAN:
        x = _raw(x_ptr, offs, mask)
    else:
        x = _unused(BLOCK)
    # AdamW: m, v (a pair: v's lo third); Lion: m (a pair: its lo second); SGD: its
    # momentum buffer, if any, never a pair
    first: tl.constexpr = RULE != SGD or MOMENTUM
    second: tl.constexpr = RULE == ADAMW or (RULE == LION and SLOW_PAIR)
    third: tl.constexpr = RULE == ADAMW and SLOW_PAIR
    s0_ptr, s0 = _fetch_state(row_base, C_STATE, first, offs, mask, S_KIND, ALIGNED, BLOCK)
    s1_ptr, s1 = _fetch_state(row_base, C_STATE + 1, second, offs, mask, S_KIND, ALIGNED,
                              BLOCK)
    s2_ptr, s2 = _fetch_state(row_base, C_STATE + 2, third, offs, mask, S_KIND, ALIGNED,
                              BLOCK)
    return (row, offs, mask, g_ptr, w_ptr, x_ptr, s0_ptr, s1_ptr, s2_ptr,
            g, w, x, s0, s1, s2)


# ---------------------------------------------------------------------------------------
# the update rules: ``rule.fast``, from float32 values
# ---------------------------------------------------------------------------------------


@triton.jit
def _adamw(g, m, v, c0, c1, c2, c3, c4, c5, EMULATE_FMA: tl.constexpr):
    """AdamW's moments and update (k: one_minus_beta1, beta2, one_minus_beta2,
    bias_correction2_sqrt, eps, step_size), in the eager path's operations and order."""
    m = _lerp(m, g, c0, EMULATE_FMA)
    v = _fma(g * c2, g, v * c1, EMULATE_FMA)
    denom = tl.div_rn(tl.sqrt_rn(v), c3) + c4
    update = tl.div_rn(m * -c5, denom)
    return m, v, update


@triton.jit
def _sgd(g, w, buf, c0, c1, c2, c4, WEIGHT_DECAY: tl.constexpr, MOMENTUM: tl.constexpr,
         NESTEROV: tl.constexpr, EMULATE_FMA: tl.constexpr):
    """SGD's momentum buffer and update, to be scaled by -lr (k: weight_decay, momentum,
    one_minus_dampening, lr, first_step)."""
    if WEIGHT_DECAY:
        g = _fma(w, tl.broadcast_to(c0, w.shape), g, EMULATE_FMA)
    if MOMENTUM:
        later = _fma(g, tl.broadcast_to(c2, g.shape), buf * c1, EMULATE_FMA)
        buf = tl.where(c4 != 0, g, later)
        if NESTEROV:
            g = _fma(buf, tl.broadcast_to(c1, g.shape), g, EMULATE_FMA)
        else:
            g = buf
    return buf, g


@triton.jit
def _lion(g, m, c0, c1, EMULATE_FMA: tl.constexpr):
    """Lion's momentum and update, to be scaled by -lr (k: one_minus_beta1,
    one_minus_beta2)."""
    mixed = _lerp(m, g, c0, EMULATE_FMA)
    update = (mixed > 0).to(tl.float32) - (mixed < 0).to(tl.float32)  # torch.sign
    return _lerp(m, g, c1, EMULATE_FMA), update


# ---------------------------------------------------------------------------------------
# the landings: ``strategy.load_weight`` and ``strategy.land``
# ---------------------------------------------------------------------------------------


@triton.jit
def _weight(w, x, LANDING: tl.constexpr, W_KIND: tl.constexpr, X_KIND: tl.constexpr):
    """The represented weight as float32, from its raw columns."""
    if LANDING == L_MIXED:
        return _value(x, F32)
    elif LANDING == L_LIGHT or LANDING == L_PLUS:
        return _value(w, W_KIND) + _value(x, X_KIND)
    elif LANDING == L_SPLIT:
        low = x.to(tl.uint32)
        up = (low > 0x8000).to(tl.uint32)  # rounding.split_decode
        return (((w.to(tl.uint32) - up) << 16) | low).to(tl.float32, bitcast=True)
    else:
        return _value(w, W_KIND)


@triton.jit
def _land_kahan(w, x, update, step_scale, lr_wd, w_ptr, x_ptr, offs, mask,
                W_KIND: tl.constexpr, X_KIND: tl.constexpr, DECAY: tl.constexpr,
                HAS_SCALE: tl.constexpr, EMULATE_FMA: tl.constexpr, HW: tl.constexpr):
    """Kahan summation: the update plus the compensation lands on the weight, and what the
    rounded add failed to land becomes the compensation (normalised with the weight)."""
    if DECAY:
        start = -w * lr_wd
    else:
        start = tl.full(w.shape, 0.0, tl.float32)
    corrected = _axpy(start, update, step_scale, HAS_SCALE, EMULATE_FMA) + _value(x, X_KIND)
    hi = _round(w + corrected, W_KIND, HW)
    # what the rounded add failed to land: float32 subtraction of nearby values, exact
    lost = _round(tl.where(_finite(hi), corrected - (hi - w), 0.0), X_KIND, HW)
    hi, lost = _normalize(hi, lost, W_KIND, X_KIND, HW)
    _store(w_ptr, offs, hi, mask, W_KIND, HW)
    _store(x_ptr, offs, lost, mask, X_KIND, HW)


@triton.jit
def _land_new(new, w_ptr, x_ptr, offs, mask, draw, LANDING: tl.constexpr,
              W_KIND: tl.constexpr, HW: tl.constexpr):
    """Store the new float32 weight under every landing but Kahan's."""
    if LANDING == L_FP32:
        _store(w_ptr, offs, new, mask, F32, HW)
    elif LANDING == L_MIXED:
        _store(x_ptr, offs, new, mask, F32, HW)
        _store(w_ptr, offs, new, mask, W_KIND, HW)
    elif LANDING == L_BF16:
        _store(w_ptr, offs, new, mask, W_KIND, HW)
    elif LANDING == L_STOCHASTIC:
        tl.store(w_ptr + offs, _stochastic_bf16(new, draw, HW).to(tl.uint16), mask=mask)
    elif LANDING == L_SPLIT:
        # rounding.split_encode: the bf16 weight nearest the master, its low 16 bits
        bits = new.to(tl.uint32, bitcast=True)
        low = bits & 0xFFFF
        top = (bits >> 16) + (low > 0x8000).to(tl.uint32)
        tl.store(w_ptr + offs, top.to(tl.uint16), mask=mask)
        tl.store(x_ptr + offs, low.to(tl.uint16), mask=mask)
    else:
        # L_LIGHT, L_PLUS: the new weight as a pair (hi, lo)
        _store_pair(w_ptr, x_ptr, offs, new, mask, W_KIND, HW)


@triton.jit
def _draw(table, row, step, offs, LANDING: tl.constexpr, CAPTURABLE: tl.constexpr):
    """Stochastic rounding's draws of the tile (0 for the other landings)."""
    if LANDING == L_STOCHASTIC:
        row_base = table + row * NCOL
        if CAPTURABLE:
            counter = tl.load(row_base + C_STEP).to(tl.pointer_type(tl.float32))
            return _uniform(row_base, tl.load(counter).to(tl.int64), offs)
        else:
            return _uniform(row_base, step.to(tl.int64), offs)
    else:
        return tl.full(offs.shape, 0.0, tl.float32)


# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------


@triton.jit
def _coefficient(coefs, row, j: tl.constexpr, value, CAPTURABLE: tl.constexpr):
    """Coefficient ``j``: the argument, or the row's entry of the device table."""
    if CAPTURABLE:
        return tl.load(coefs + row * NCOEF + j)
    else:
        return value


@triton.jit
def _gradient(raw, scale, W_KIND: tl.constexpr, SCALED: tl.constexpr,
              MAXIMIZE: tl.constexpr):
    """The gradient, float32, unscaled and negated in registers (``group.prepare_grad``)."""
    g = _value(raw, W_KIND)
    if SCALED:
        g = tl.div_rn(g, tl.load(scale))
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _step_tile(tile, table, coefs, scale, k0, k1, k2, k3, k4, k5, k6, k7, step,
               RULE: tl.constexpr, LANDING: tl.constexpr, W_KIND: tl.constexpr,
               X_KIND: tl.constexpr, S_KIND: tl.constexpr, SLOW_PAIR: tl.constexpr,
               DECAY: tl.constexpr, SCALED: tl.constexpr, MAXIMIZE: tl.constexpr,
               CAPTURABLE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
               MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr,
               EMULATE_FMA: tl.constexpr, HW: tl.constexpr):
    """One fetched tile: the rule's update from float32 values, its states stored, the
    landing: ``w_new = w * decay + update * scale`` (SGD and Lion: scale -lr)."""
    row, offs, mask, g_ptr, w_ptr, x_ptr, s0_ptr, s1_ptr, s2_ptr, g, w, x, s0, s1, s2 = tile
    c0 = _coefficient(coefs, row, 0, k0, CAPTURABLE)
    c1 = _coefficient(coefs, row, 1, k1, CAPTURABLE)
    c2 = _coefficient(coefs, row, 2, k2, CAPTURABLE)
    c3 = _coefficient(coefs, row, 3, k3, CAPTURABLE)
    c4 = _coefficient(coefs, row, 4, k4, CAPTURABLE)
    c5 = _coefficient(coefs, row, 5, k5, CAPTURABLE)
    c6 = _coefficient(coefs, row, 6, k6, CAPTURABLE)
    c7 = _coefficient(coefs, row, 7, k7, CAPTURABLE)
    grad = _gradient(g, scale, W_KIND, SCALED, MAXIMIZE)
    weight = _weight(w, x, LANDING, W_KIND, X_KIND)
    if RULE == ADAMW:
        v = _value(s1, S_KIND)
        if SLOW_PAIR:
            v = v + _value(s2, S_KIND)
        m, v, update = _adamw(grad, _value(s0, S_KIND), v, c0, c1, c2, c3, c4, c5,
                              EMULATE_FMA)
        _store(s0_ptr, offs, m, mask, S_KIND, HW)
        _store_state(s1_ptr, s2_ptr, offs, v, mask, S_KIND, SLOW_PAIR, HW)
        decay, lr_wd, step_scale = c6, c7, c5  # step_scale unused: no scale
    elif RULE == SGD:
        buf, update = _sgd(grad, weight, _value(s0, S_KIND), c0, c1, c2, c4, WEIGHT_DECAY,
                           MOMENTUM, NESTEROV, EMULATE_FMA)
        if MOMENTUM:
            _store(s0_ptr, offs, buf, mask, S_KIND, HW)
        decay, lr_wd, step_scale = c0, c0, -c3  # decay, lr_wd unused: SGD's decay is 1
    else:
        m = _value(s0, S_KIND)
        if SLOW_PAIR:
            m = m + _value(s1, S_KIND)
        m, update = _lion(grad, m, c0, c1, EMULATE_FMA)
        _store_state(s0_ptr, s1_ptr, offs, m, mask, S_KIND, SLOW_PAIR, HW)
        decay, lr_wd, step_scale = c3, c4, -c2
    if LANDING == L_KAHAN:
        _land_kahan(weight, x, update, step_scale, lr_wd, w_ptr, x_ptr, offs, mask, W_KIND,
                    X_KIND, DECAY, HAS_SCALE, EMULATE_FMA, HW)
    else:
        if DECAY:
            new = _axpy(weight * decay, update, step_scale, HAS_SCALE, EMULATE_FMA)
        else:
            new = _axpy(weight, update, step_scale, HAS_SCALE, EMULATE_FMA)
        draw = _draw(table, row, step, offs, LANDING, CAPTURABLE)
        _land_new(new, w_ptr, x_ptr, offs, mask, draw, LANDING, W_KIND, HW)


@triton.jit(do_not_specialize=["step", "tiles", "whole"])
def multi_tensor_step(
    table,  # int64 [rows, NCOL]: per tensor its columns' addresses, size, draws' counter
    grads,  # int64 [rows]: the address of each tensor's gradient
    blocks,  # int32 [tiles, 2]: (row, block index in that row's tensor), whole blocks first
    coefs,  # float32 [rows, NCOEF]: per-row coefficients (CAPTURABLE), else unused
    scale,  # float32 [1]: GradScaler's scale (SCALED), else unused
    found,  # float32 [1]: nonzero skips the step, nothing written (SKIPPABLE), else unused
    k0, k1, k2, k3, k4, k5, k6, k7,  # float32 coefficients (``launch.COEFFICIENTS``)
    step,  # int: every row's step (not CAPTURABLE: then each row's counter)
    tiles,  # int: the number of (row, block) pairs in ``blocks``
    whole,  # int: how many of them are whole blocks (the rest: tensors' last, partial ones)
    RULE: tl.constexpr,
    LANDING: tl.constexpr,
    W_KIND: tl.constexpr,  # the weight's (and gradient's) dtype
    X_KIND: tl.constexpr,  # the second weight component's (compensation, lo)
    S_KIND: tl.constexpr,  # the rule states'
    SLOW_PAIR: tl.constexpr,  # the slow EMA is a pair (mcf_slow_states)
    DECAY: tl.constexpr,  # decay != 1
    SCALED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    CAPTURABLE: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr,  # SGD: weight_decay != 0
    MOMENTUM: tl.constexpr,  # SGD: momentum != 0
    NESTEROV: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # the rule's update lands scaled (SGD, Lion: by -lr)
    EMULATE_FMA: tl.constexpr,  # the interpreter: fma in float64 (``_fma_emulated``)
    HW: tl.constexpr,  # a GPU: hardware float32 -> bf16 conversions (``_bf16_bits``)
    SKIPPABLE: tl.constexpr,  # read ``found`` (the device's non-finite verdict)
    WHOLE: tl.constexpr,  # ``whole`` > 0: the unmasked loop is compiled
    TAILS: tl.constexpr,  # ``tiles`` > ``whole``: the masked loop is compiled
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes
    BLOCK: tl.constexpr,
):
    """Persistent programs: program ``p`` steps whole blocks ``p, p + P, p + 2P ...`` (``P``
    programs), then tails ``whole + p, whole + p + P ...``: one launch a bucket, whatever
    its tensors' sizes (issue #29: each launch is host time). Over whole blocks it fetches
    each next tile (its loads issued) before it computes the current one, so that a tile's
    memory traffic overlaps the previous tile's arithmetic; a fetch past the last whole
    block re-reads the last one (never out of range; its values are dropped). Tails are
    masked, element by element (a size loaded from memory has no known divisibility, so a
    mask built from it forbids vector loads), and fetched where computed, so that a thread
    holds one tile's registers there, not two. With ``SKIPPABLE`` and a nonzero ``found``
    no tile is stepped: every weight and state is left as it was, with no host involved."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    last_whole = whole
    count = tiles
    if SKIPPABLE:
        skipped = tl.load(found) != 0
        last_whole = tl.where(skipped, 0, whole)
        count = tl.where(skipped, 0, tiles)
    if WHOLE:
        tile = _fetch(table, grads, blocks, tl.minimum(pid, whole - 1), RULE, LANDING,
                      W_KIND, X_KIND, S_KIND, SLOW_PAIR, MOMENTUM, False, ALIGNED, BLOCK)
        for i in range(pid, last_whole, programs):
            following = _fetch(table, grads, blocks, tl.minimum(i + programs, whole - 1),
                               RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR, MOMENTUM,
                               False, ALIGNED, BLOCK)
            _step_tile(tile, table, coefs, scale, k0, k1, k2, k3, k4, k5, k6, k7, step,
                       RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR, DECAY, SCALED,
                       MAXIMIZE, CAPTURABLE, WEIGHT_DECAY, MOMENTUM, NESTEROV, HAS_SCALE,
                       EMULATE_FMA, HW)
            tile = following
    if TAILS:
        for i in range(whole + pid, count, programs):
            tile = _fetch(table, grads, blocks, i, RULE, LANDING, W_KIND, X_KIND, S_KIND,
                          SLOW_PAIR, MOMENTUM, True, ALIGNED, BLOCK)
            _step_tile(tile, table, coefs, scale, k0, k1, k2, k3, k4, k5, k6, k7, step,
                       RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR, DECAY, SCALED,
                       MAXIMIZE, CAPTURABLE, WEIGHT_DECAY, MOMENTUM, NESTEROV, HAS_SCALE,
                       EMULATE_FMA, HW)


@triton.jit
def _tile_nonfinite(table, grads, blocks, i, W_KIND: tl.constexpr, MASKED: tl.constexpr,
                    ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """1 where an element of tile ``i``'s gradient is inf or nan, else 0 (masked lanes
    load 0: finite)."""
    row = tl.load(blocks + 2 * i).to(tl.int64)
    offs = tl.load(blocks + 2 * i + 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < tl.load(table + row * NCOL + C_NUMEL)
    else:
        mask = tl.full([BLOCK], True, tl.int1)
    g = _value(_raw(_pointer(grads + row, W_KIND, ALIGNED), offs, mask), W_KIND)
    return tl.where(_finite(g), 0, 1)


@triton.jit(do_not_specialize=["tiles", "whole"])
def nonfinite_check(
    table,  # int64 [rows, NCOL]: the step's launch table (its numel column: tails)
    grads,  # int64 [rows]: the address of each tensor's gradient
    blocks,  # int32 [tiles, 2]: (row, block index in that row's tensor), whole blocks first
    found,  # float32 [1]: raised to 1.0 where a gradient element is inf or nan
    tiles,  # int: the number of (row, block) pairs in ``blocks``
    whole,  # int: how many of them are whole blocks
    W_KIND: tl.constexpr,  # the gradients' dtype
    WHOLE: tl.constexpr,  # ``whole`` > 0
    TAILS: tl.constexpr,  # ``tiles`` > ``whole``
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes
    BLOCK: tl.constexpr,
):
    """The default non-finite check of a planned step, over the step's own tiles (issue
    #29), in one launch (whole blocks unmasked, then tails masked): ``found`` is raised to
    1.0 where an element is inf or nan, never lowered (every launch of the step raises the
    same verdict, zeroed before them), one atomic per program. The host reads nothing and
    walks no tensor: the gradients' addresses are the launch's table."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    bad = tl.full([BLOCK], 0, tl.int32)
    if WHOLE:
        for i in range(pid, whole, programs):
            bad = bad | _tile_nonfinite(table, grads, blocks, i, W_KIND, False, ALIGNED, BLOCK)
    if TAILS:
        for i in range(whole + pid, tiles, programs):
            bad = bad | _tile_nonfinite(table, grads, blocks, i, W_KIND, True, ALIGNED, BLOCK)
    # a reduction by a combine function of this module (tl.max is a @jit helper of
    # triton.language.standard: see the module docstring)
    tl.atomic_max(found, tl.reduce(bad, 0, _either).to(tl.float32))


@triton.jit
def _either(a, b):
    return a | b


@triton.jit
def stochastic_probe(x, draw, out, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    """``out = bf16 bits of stochastic rounding of x with draws``, elementwise by
    :func:`_stochastic_bf16`: the tests check its exponent arithmetic against an exact
    division at every bf16 spacing."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = _stochastic_bf16(tl.load(x + offs, mask=mask), tl.load(draw + offs, mask=mask), HW)
    tl.store(out + offs, bits.to(tl.uint16), mask=mask)
