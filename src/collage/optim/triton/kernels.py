"""The Triton kernels: one multi-tensor step of AdamW, SGD or Lion under a precision
strategy, ``kernels.fast_step``'s float32 arithmetic operation for operation.

This module is loaded by ``launch.py`` (``launch.kernel_module``) once per mode, compiled
for a GPU or interpreted on CPU (``TRITON_INTERPRET=1``): ``@triton.jit`` reads the mode
when it decorates. It needs Triton; nothing else in collage imports it. It calls Triton's
builtins only (``tl.full``, not ``tl.zeros_like``): the ``@jit`` helpers of
``triton.language.standard`` were decorated in the mode of the process's import of Triton,
and a compiled one cannot run in the interpreted copy of this module.

One launch steps many tensors. Program ``p`` reads ``blocks[p] = (row, block)`` and steps
elements ``block * BLOCK ...`` of the tensor of ``table[row]`` (``launch.COLUMNS``: the
addresses of its components, its size, its draws' counter). Every stored component is read
once and written once, in its own dtype, in one pass; the gradient is read in its dtype and
unscaled and negated in registers.

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
* bf16 rounding is done on the bit pattern, nearest-even (``rounding.h``'s ``bf_round``),
  so the interpreter and the GPU round the same way whatever their conversions do.
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
def _bf16_bits(x):
    """float32 -> bf16 bits (in a uint32): nearest, ties to even, on the integer view; NaN
    -> 0xFFFF, as ATen's CPU conversion (``rounding.h``: ``bf_round``)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0xFFFF, r)


@triton.jit
def _widen(bits):
    """bf16 bits (in a uint32) -> float32, exactly."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round(x, KIND: tl.constexpr):
    """``x`` rounded to nearest in a 16-bit column's dtype, back in float32 (the value a
    stored component holds)."""
    if KIND == BF16:
        return _widen(_bf16_bits(x))
    else:
        return x.to(tl.float16).to(tl.float32)


# ---------------------------------------------------------------------------------------
# columns: loads and stores in each component's dtype
# ---------------------------------------------------------------------------------------


@triton.jit
def _load(address, offs, mask, KIND: tl.constexpr):
    """Elements ``offs`` of the column at ``address`` (an int64), as float32."""
    if KIND == F32:
        return tl.load(address.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
    elif KIND == BF16:
        h = tl.load(address.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        return _widen(h.to(tl.uint32))
    else:
        h = tl.load(address.to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0)
        return h.to(tl.float32)


@triton.jit
def _store(address, offs, x, mask, KIND: tl.constexpr):
    """Store float32 ``x`` rounded to nearest into the column (float32: as is)."""
    if KIND == F32:
        tl.store(address.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
    elif KIND == BF16:
        tl.store(address.to(tl.pointer_type(tl.uint16)) + offs, _bf16_bits(x).to(tl.uint16),
                 mask=mask)
    else:
        tl.store(address.to(tl.pointer_type(tl.float16)) + offs, x.to(tl.float16), mask=mask)


@triton.jit
def _normalize(hi, lo, HI_KIND: tl.constexpr, LO_KIND: tl.constexpr):
    """``strategy.normalize_pair`` on stored values (float32 holding them): ``hi`` the
    nearest (ties to even) of ``hi + lo``, ``lo`` the exact rest; +0 where ``hi`` is not
    finite. ``hi + lo`` and the rest are exact in float32."""
    total = hi + lo
    nearest = _round(total, HI_KIND)
    return nearest, _round(tl.where(_finite(nearest), total - nearest, 0.0), LO_KIND)


@triton.jit
def _store_pair(hi_address, lo_address, offs, x, mask, KIND: tl.constexpr):
    """Store float32 ``x`` as an MCF pair: ``hi`` its nearest value, ``lo`` the residual
    ``x - hi`` (exact in float32: Sterbenz), rounded, +0 where ``hi`` is not finite
    (``strategy.residual``); then normalised (the canonical form)."""
    hi = _round(x, KIND)
    lo = _round(tl.where(_finite(hi), x - hi, 0.0), KIND)
    hi, lo = _normalize(hi, lo, KIND, KIND)
    _store(hi_address, offs, hi, mask, KIND)
    _store(lo_address, offs, lo, mask, KIND)


@triton.jit
def _address(cell, ALIGNED: tl.constexpr):
    """The int64 address in ``cell``. ``ALIGNED``: the host checked it is a multiple of 16
    bytes; said to the compiler, it lets a thread load its elements in 16-byte vectors
    (an address loaded from memory carries no alignment of its own)."""
    address = tl.load(cell)
    if ALIGNED:
        address = tl.multiple_of(address, 16)
    return address


@triton.jit
def _load_state(base, column: tl.constexpr, offs, mask, KIND: tl.constexpr,
                PAIR: tl.constexpr, ALIGNED: tl.constexpr):
    """A rule state as float32: one column, or a pair ``hi + lo`` (columns ``column`` and
    ``column + 1``) summed in float32."""
    x = _load(_address(base + column, ALIGNED), offs, mask, KIND)
    if PAIR:
        x = x + _load(_address(base + column + 1, ALIGNED), offs, mask, KIND)
    return x


@triton.jit
def _store_state(base, column: tl.constexpr, offs, x, mask, KIND: tl.constexpr,
                 PAIR: tl.constexpr, ALIGNED: tl.constexpr):
    if PAIR:
        _store_pair(_address(base + column, ALIGNED), _address(base + column + 1, ALIGNED),
                    offs, x, mask, KIND)
    else:
        _store(_address(base + column, ALIGNED), offs, x, mask, KIND)


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
def _uniform(base, step, offs):
    """``draws.counter_uniform`` of the elements ``offs`` of the row's tensor at ``step``:
    the key words of ``draws.stochastic_key`` mixed here from the row's state after (seed,
    position), then two rounds of the 32-bit hash of the element's index in the whole
    tensor."""
    state = tl.load(base + C_MIX).to(tl.uint64, bitcast=True)
    key = _mix64(state, step.to(tl.uint64)) & 0x7FFFFFFFFFFFFFFF
    # stochastic_key's int32 words: (low 32 bits) - 2**31, and the next 31 bits
    key0 = (key & 0xFFFFFFFF).to(tl.uint32) ^ 0x80000000
    key1 = ((key >> 32) & 0x7FFFFFFF).to(tl.uint32)
    index = (tl.load(base + C_INDEX) + offs).to(tl.uint32)
    h = _mix32(_mix32(index ^ key0) ^ key1)
    return ((h >> 8) & 0xFFFFFF).to(tl.float32) * (2.0**-24)


@triton.jit
def _stochastic_bf16(x, draw):
    """``rounding._stochastic_round_bf16`` (``rounding.h``: ``bf_stochastic``), bit for
    bit: the neighbour of the nearest bf16 on the other side of ``x`` with probability
    ``|x - nearest| / spacing``. Returns bf16 bits in a uint32."""
    nearest_bits = _bf16_bits(x)
    nearest = _widen(nearest_bits)
    error = x - nearest  # exact (Sterbenz)
    finite = _finite(nearest)
    bits = tl.where(finite, nearest.to(tl.uint32, bitcast=True), 0)
    away = ((error > 0) == (nearest > 0)) | (nearest == 0)
    step = tl.where(away, 0x10000, 0xFFFF0000).to(tl.uint32)  # +-1 bf16 ulp in magnitude
    tiny = tl.where(error < 0, 0x80010000, 0x00010000).to(tl.uint32)  # +-smallest subnormal
    neighbour = tl.where(nearest == 0, tiny, bits + step).to(tl.float32, bitcast=True)
    spacing = tl.abs(neighbour - nearest)
    probability = tl.div_rn(tl.abs(error), spacing)
    take = (draw < probability) & (error != 0) & _finite(spacing) & finite
    return tl.where(take, neighbour.to(tl.uint32, bitcast=True) >> 16, nearest_bits)


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


@triton.jit(do_not_specialize=["step"])
def multi_tensor_step(
    table,  # int64 [rows, NCOL]: per tensor its columns' addresses, size, draws' counter
    grads,  # int64 [rows]: the address of each tensor's gradient
    blocks,  # int32 [programs, 2]: (row, block index in that row's tensor)
    coefs,  # float32 [rows, NCOEF]: per-row coefficients (CAPTURABLE), else unused
    scale,  # float32 [1]: GradScaler's scale (SCALED), else unused
    k0, k1, k2, k3, k4, k5, k6, k7,  # float32 coefficients (``launch.COEFFICIENTS``)
    step,  # int: every row's step (not CAPTURABLE: then each row's counter)
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
    EMULATE_FMA: tl.constexpr,
    MASKED: tl.constexpr,  # these programs step their tensor's last, partial blocks
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(blocks + 2 * pid).to(tl.int64)
    block = tl.load(blocks + 2 * pid + 1).to(tl.int64)
    base = table + row * NCOL
    offs = block * BLOCK + tl.arange(0, BLOCK)
    # A size loaded from memory has no known divisibility, so a mask built from it varies
    # element by element and forbids vector loads: whole blocks run unmasked, in their
    # own launch, and only the tails compare
    if MASKED:
        mask = offs < tl.load(base + C_NUMEL)
    else:
        mask = tl.full([BLOCK], True, tl.int1)
    c0 = _coefficient(coefs, row, 0, k0, CAPTURABLE)
    c1 = _coefficient(coefs, row, 1, k1, CAPTURABLE)
    c2 = _coefficient(coefs, row, 2, k2, CAPTURABLE)
    c3 = _coefficient(coefs, row, 3, k3, CAPTURABLE)
    c4 = _coefficient(coefs, row, 4, k4, CAPTURABLE)
    c5 = _coefficient(coefs, row, 5, k5, CAPTURABLE)
    c6 = _coefficient(coefs, row, 6, k6, CAPTURABLE)
    c7 = _coefficient(coefs, row, 7, k7, CAPTURABLE)

    # the gradient, float32, unscaled and negated in registers (``group.prepare_grad``)
    g = _load(_address(grads + row, ALIGNED), offs, mask, W_KIND)
    if SCALED:
        g = tl.div_rn(g, tl.load(scale))
    if MAXIMIZE:
        g = -g

    # the represented weight, float32 (``strategy.load_weight``)
    param = _address(base + C_PARAM, ALIGNED)
    extra = _address(base + C_EXTRA, ALIGNED)
    if LANDING == L_MIXED:
        w = _load(extra, offs, mask, F32)
    elif LANDING == L_LIGHT or LANDING == L_PLUS:
        w = _load(param, offs, mask, W_KIND) + _load(extra, offs, mask, X_KIND)
    elif LANDING == L_SPLIT:
        hi = tl.load(param.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        low = tl.load(extra.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        low = low.to(tl.uint32)
        up = (low > 0x8000).to(tl.uint32)  # rounding.split_decode
        w = (((hi.to(tl.uint32) - up) << 16) | low).to(tl.float32, bitcast=True)
    else:
        w = _load(param, offs, mask, W_KIND)

    # the rule's update (``rule.fast``): w_new = w * decay + update * scale
    if RULE == ADAMW:
        # k: one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
        # step_size, decay, lr_wd
        m = _load_state(base, C_STATE, offs, mask, S_KIND, False, ALIGNED)
        v = _load_state(base, C_STATE + 1, offs, mask, S_KIND, SLOW_PAIR, ALIGNED)
        m = _lerp(m, g, c0, EMULATE_FMA)
        v = _fma(g * c2, g, v * c1, EMULATE_FMA)
        denom = tl.div_rn(tl.sqrt_rn(v), c3) + c4
        update = tl.div_rn(m * -c5, denom)
        decay = c6
        lr_wd = c7
        _store_state(base, C_STATE, offs, m, mask, S_KIND, False, ALIGNED)
        _store_state(base, C_STATE + 1, offs, v, mask, S_KIND, SLOW_PAIR, ALIGNED)
        step_scale = c5  # unused: AdamW's update has no scale
    elif RULE == SGD:
        # k: weight_decay, momentum, one_minus_dampening, lr, first_step
        if WEIGHT_DECAY:
            g = _fma(w, tl.broadcast_to(c0, w.shape), g, EMULATE_FMA)
        if MOMENTUM:
            buf = _load_state(base, C_STATE, offs, mask, S_KIND, False, ALIGNED)
            later = _fma(g, tl.broadcast_to(c2, g.shape), buf * c1, EMULATE_FMA)
            buf = tl.where(c4 != 0, g, later)
            _store_state(base, C_STATE, offs, buf, mask, S_KIND, False, ALIGNED)
            if NESTEROV:
                g = _fma(buf, tl.broadcast_to(c1, g.shape), g, EMULATE_FMA)
            else:
                g = buf
        update = g
        decay = c0  # unused: SGD's decay is 1
        lr_wd = c0  # unused
        step_scale = -c3
    else:
        # LION; k: one_minus_beta1, one_minus_beta2, lr, decay, lr_wd
        m = _load_state(base, C_STATE, offs, mask, S_KIND, SLOW_PAIR, ALIGNED)
        mixed = _lerp(m, g, c0, EMULATE_FMA)
        update = (mixed > 0).to(tl.float32) - (mixed < 0).to(tl.float32)  # torch.sign
        m = _lerp(m, g, c1, EMULATE_FMA)
        _store_state(base, C_STATE, offs, m, mask, S_KIND, SLOW_PAIR, ALIGNED)
        decay = c3
        lr_wd = c4
        step_scale = -c2

    # the landing (``strategy.land``); SGD and Lion scale their update by -lr in it
    if LANDING == L_KAHAN:
        if DECAY:
            start = -w * lr_wd
        else:
            start = tl.full(w.shape, 0.0, tl.float32)
        corrected = _axpy(start, update, step_scale, HAS_SCALE, EMULATE_FMA) \
            + _load(extra, offs, mask, X_KIND)
        hi = _round(w + corrected, W_KIND)
        # what the rounded add failed to land: float32 subtraction of nearby values, exact
        lost = _round(tl.where(_finite(hi), corrected - (hi - w), 0.0), X_KIND)
        hi, lost = _normalize(hi, lost, W_KIND, X_KIND)
        _store(param, offs, hi, mask, W_KIND)
        _store(extra, offs, lost, mask, X_KIND)
    else:
        if DECAY:
            new = _axpy(w * decay, update, step_scale, HAS_SCALE, EMULATE_FMA)
        else:
            new = _axpy(w, update, step_scale, HAS_SCALE, EMULATE_FMA)
        if LANDING == L_FP32:
            _store(param, offs, new, mask, F32)
        elif LANDING == L_MIXED:
            _store(extra, offs, new, mask, F32)
            _store(param, offs, new, mask, W_KIND)
        elif LANDING == L_BF16:
            _store(param, offs, new, mask, W_KIND)
        elif LANDING == L_STOCHASTIC:
            if CAPTURABLE:
                row_step = tl.load(tl.load(base + C_STEP).to(tl.pointer_type(tl.float32)))
                draw = _uniform(base, row_step.to(tl.int64), offs)
            else:
                draw = _uniform(base, step.to(tl.int64), offs)
            rounded = _stochastic_bf16(new, draw)
            tl.store(param.to(tl.pointer_type(tl.uint16)) + offs, rounded.to(tl.uint16),
                     mask=mask)
        elif LANDING == L_SPLIT:
            # rounding.split_encode: the bf16 weight nearest the master, its low 16 bits
            bits = new.to(tl.uint32, bitcast=True)
            low = bits & 0xFFFF
            top = (bits >> 16) + (low > 0x8000).to(tl.uint32)
            tl.store(param.to(tl.pointer_type(tl.uint16)) + offs, top.to(tl.uint16),
                     mask=mask)
            tl.store(extra.to(tl.pointer_type(tl.uint16)) + offs, low.to(tl.uint16),
                     mask=mask)
        else:
            # L_LIGHT, L_PLUS: the new weight as a pair (hi, lo)
            _store_pair(param, extra, offs, new, mask, W_KIND)
