"""The step kernel, ``multi_tensor_step``: a tile fetched (its row, elements and every column
it reads, as stored), its rule's update from float32 values, its states stored, its
landing; persistent programs walking the launch's tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _axpy
from .codes import (ADAMW, C_EXTRA, C_NUMEL, C_PARAM, C_STATE, F32, L_KAHAN, L_LIGHT, L_MIXED,
                    L_PLUS, L_SPLIT, LION, NCOEF, NCOL, SGD)
from .columns import _pointer, _raw, _store, _store_state, _value
from .landings import _draw, _land_kahan, _land_new, _weight
from .rules import _adamw, _lion, _sgd


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
def _coefficient(coefs, row, j: tl.constexpr, value, CAPTURABLE: tl.constexpr):
    """Coefficient ``j``: the argument, or the row's entry of the device table."""
    if CAPTURABLE:
        return tl.load(coefs + row * NCOEF + j)
    else:
        return value


@triton.jit
def _fetch(table, grads, blocks, i, coefs, k0, k1, k2, k3, k4, k5, k6, k7,
           RULE: tl.constexpr, LANDING: tl.constexpr,
           W_KIND: tl.constexpr, X_KIND: tl.constexpr, S_KIND: tl.constexpr,
           SLOW_PAIR: tl.constexpr, MOMENTUM: tl.constexpr, MASKED: tl.constexpr,
           CAPTURABLE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``i`` of the launch: its row, elements, coefficients and every column it reads,
    loaded as stored (the loads issued, their values used later: :func:`multi_tensor_step`
    fetches the next tile before it computes this one). The row's coefficients (CAPTURABLE:
    the device table's) are fetched with the tile, an iteration before they are used: on
    the scoreboard of this tile's data, waited on when the tile is stepped. Loaded when the
    tile was stepped, they shared a scoreboard with the next tile's data loads, and their
    first use waited for the whole next tile (issue #44)."""
    row = tl.load(blocks + 2 * i).to(tl.int64)
    block = tl.load(blocks + 2 * i + 1).to(tl.int64)
    # one call each: a tuple returned by a helper gives the interpreter's kernel-argument
    # floats back as Python floats (tl.broadcast_to then rejects them)
    c0 = _coefficient(coefs, row, 0, k0, CAPTURABLE)
    c1 = _coefficient(coefs, row, 1, k1, CAPTURABLE)
    c2 = _coefficient(coefs, row, 2, k2, CAPTURABLE)
    c3 = _coefficient(coefs, row, 3, k3, CAPTURABLE)
    c4 = _coefficient(coefs, row, 4, k4, CAPTURABLE)
    c5 = _coefficient(coefs, row, 5, k5, CAPTURABLE)
    c6 = _coefficient(coefs, row, 6, k6, CAPTURABLE)
    c7 = _coefficient(coefs, row, 7, k7, CAPTURABLE)
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
            g, w, x, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7)


# ---------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------


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
def _step_tile(tile, table, scale, step,
               RULE: tl.constexpr, LANDING: tl.constexpr, W_KIND: tl.constexpr,
               X_KIND: tl.constexpr, S_KIND: tl.constexpr, SLOW_PAIR: tl.constexpr,
               DECAY: tl.constexpr, SCALED: tl.constexpr, MAXIMIZE: tl.constexpr,
               CAPTURABLE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
               MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr,
               EMULATE_FMA: tl.constexpr, HW: tl.constexpr):
    """One fetched tile: the rule's update from float32 values, its states stored, the
    landing: ``w_new = w * decay + update * scale`` (SGD and Lion: scale -lr)."""
    (row, offs, mask, g_ptr, w_ptr, x_ptr, s0_ptr, s1_ptr, s2_ptr, g, w, x, s0, s1, s2,
     c0, c1, c2, c3, c4, c5, c6, c7) = tile  # the coefficients: loaded with the tile
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


@triton.jit
def _lanes(raw):
    """A 16-bit raw column in 32-bit lanes, as every use of it widens it first (the same
    values): done at the top of an iteration, before the next tile's loads are issued,
    it frees the registers those loads land in, so the loop carries no copy of the next
    tile (a copy waits for its loads, and ptxas placed the copies mid-way through the
    arithmetic: the end of the overlap window, issue #44)."""
    if raw.dtype == tl.uint16:
        return raw.to(tl.uint32)
    else:
        return raw


@triton.jit
def _held(c, zero, HELD: tl.constexpr):
    """A loaded coefficient moved into a register of its own at the top of an iteration:
    its bits xor ``zero`` (0, not known to the compiler), the same bits. Loaded with its
    tile one iteration ahead, a coefficient's register is needed by the next tile's load
    while the current tile still uses it; ptxas copied the next tile's value at the end
    of the arithmetic, and that copy waited for the whole next tile (issue #44: the end
    of AdamW's ``kahan`` and ``light`` overlap windows). Consumed here, at the top, a
    copy waits for this tile's loads, needed now anyway (in the SASS the compiler now
    reads most coefficients of the current tile at the top, into uniform registers, and
    nothing waits on the next tile's loads before the loop's end: ``light``'s window 489
    -> 741 of 741 instructions). ``HELD``: AdamW with the device table (SGD's and
    Lion's short loops gain nothing by it in the model, ``bf16`` SGD loses 4 points);
    otherwise, and for arguments, the coefficients are left as they are."""
    if HELD:
        return (c.to(tl.uint32, bitcast=True) ^ zero).to(tl.float32, bitcast=True)
    else:
        return c


@triton.jit
def _settled(tile, zero, HELD: tl.constexpr):
    """``tile`` with its 16-bit columns in 32-bit lanes (:func:`_lanes`) and its loaded
    coefficients in registers of their own where ``HELD`` (:func:`_held`)."""
    (row, offs, mask, g_ptr, w_ptr, x_ptr, s0_ptr, s1_ptr, s2_ptr, g, w, x, s0, s1, s2,
     c0, c1, c2, c3, c4, c5, c6, c7) = tile
    return (row, offs, mask, g_ptr, w_ptr, x_ptr, s0_ptr, s1_ptr, s2_ptr, _lanes(g),
            _lanes(w), _lanes(x), _lanes(s0), _lanes(s1), _lanes(s2),
            _held(c0, zero, HELD), _held(c1, zero, HELD), _held(c2, zero, HELD),
            _held(c3, zero, HELD), _held(c4, zero, HELD), _held(c5, zero, HELD),
            _held(c6, zero, HELD), _held(c7, zero, HELD))


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
        tile = _fetch(table, grads, blocks, tl.minimum(pid, whole - 1), coefs, k0, k1, k2,
                      k3, k4, k5, k6, k7, RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR,
                      MOMENTUM, False, CAPTURABLE, ALIGNED, BLOCK)
        zero = (whole >> 31).to(tl.uint32)  # whole >= 0: 0, not known to the compiler
        for i in range(pid, last_whole, programs):
            tile = _settled(tile, zero, CAPTURABLE and RULE == ADAMW)
            following = _fetch(table, grads, blocks, tl.minimum(i + programs, whole - 1),
                               coefs, k0, k1, k2, k3, k4, k5, k6, k7, RULE, LANDING, W_KIND,
                               X_KIND, S_KIND, SLOW_PAIR, MOMENTUM, False, CAPTURABLE,
                               ALIGNED, BLOCK)
            _step_tile(tile, table, scale, step,
                       RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR, DECAY, SCALED,
                       MAXIMIZE, CAPTURABLE, WEIGHT_DECAY, MOMENTUM, NESTEROV, HAS_SCALE,
                       EMULATE_FMA, HW)
            tile = following
    if TAILS:
        for i in range(whole + pid, count, programs):
            tile = _fetch(table, grads, blocks, i, coefs, k0, k1, k2, k3, k4, k5, k6, k7,
                          RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR, MOMENTUM, True,
                          CAPTURABLE, ALIGNED, BLOCK)
            _step_tile(tile, table, scale, step,
                       RULE, LANDING, W_KIND, X_KIND, S_KIND, SLOW_PAIR, DECAY, SCALED,
                       MAXIMIZE, CAPTURABLE, WEIGHT_DECAY, MOMENTUM, NESTEROV, HAS_SCALE,
                       EMULATE_FMA, HW)
