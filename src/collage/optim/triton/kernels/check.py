"""The non-finite check kernel, ``nonfinite_check``: a planned step's default check over the
step's own tiles, its verdict raised on the device."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _finite
from .codes import C_NUMEL, F16, F32, NCOL
from .columns import _pointer, _raw, _value

# Whole blocks a program checks per iteration of its loop, as one [CHECK_TILES, words] tile.
# One block at a time a thread had its 16 bytes (bf16) in flight behind a chain of two
# dependent loads (the block's pair, its gradient's address): about 8 KB per SM where
# Little's law asks about 22 KB on an H200, latency-bound (issue #44). 8 blocks, the next 8
# located while these are in flight: 48 KB per SM in the sm_90 SASS
# (``benchmarks/gpu_model.py``; ptxas interleaves the loads with their tests)
CHECK_TILES: tl.constexpr = tl.constexpr(8)


@triton.jit
def _words(addresses, ALIGNED: tl.constexpr):
    """int64 addresses (a vector) as pointers to 32-bit words (two 16-bit elements, or one
    float32), with ``_pointer``'s 16-byte hint where the host checked it."""
    pointer = addresses.to(tl.pointer_type(tl.uint32))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _locate(grads, blocks, first, stride, last, KIND: tl.constexpr, ALIGNED: tl.constexpr,
            BLOCK: tl.constexpr):
    """The whole blocks ``first, first + stride, ... first + (CHECK_TILES - 1) * stride``
    (none past ``last``: that one is read again, an idempotent check): their gradients as
    32-bit words, pointers [CHECK_TILES] and offsets [CHECK_TILES, words a block]."""
    words: tl.constexpr = BLOCK if KIND == F32 else BLOCK // 2
    i = tl.minimum(first + tl.arange(0, CHECK_TILES) * stride, last)
    row = tl.load(blocks + 2 * i).to(tl.int64)
    block = tl.load(blocks + 2 * i + 1).to(tl.int64)
    pointer = _words(tl.load(grads + row), ALIGNED)
    return pointer, block[:, None] * words + tl.arange(0, words)[None, :]


@triton.jit
def _carries(w, KIND: tl.constexpr):
    """Each element's exponent field of the words ``w`` plus its lowest bit: the field's
    top bit carries into the element's sign bit exactly where the exponent is all ones
    (inf or nan), and never beyond it (all ones plus one is the sign bit alone). OR-ed
    over blocks, the sign bits say whether any element was not finite: two integer
    operations a word (two 16-bit elements)."""
    if KIND == F32:
        return (w & 0x7F800000) + 0x00800000
    elif KIND == F16:
        return (w & 0x7C007C00) + 0x04000400
    else:
        return (w & 0x7F807F80) + 0x00800080


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
    if WHOLE and ALIGNED:
        # blocks first, first + P, ... first + 7P (program p's share as one block at a
        # time, p, p + P, ..., was), 32-bit words: 16-byte aligned addresses; each group
        # located one ahead, so that the next group's two dependent loads (pairs,
        # addresses) run while this group's data is in flight
        stride = programs * CHECK_TILES
        pointer, offs = _locate(grads, blocks, pid, programs, whole - 1, W_KIND, ALIGNED,
                                BLOCK)
        carries = tl.full([offs.shape[1]], 0, tl.uint32)  # OR-ed over the blocks
        for first in range(pid, whole, stride):
            words = tl.load(pointer[:, None] + offs)
            pointer, offs = _locate(grads, blocks, first + stride, programs, whole - 1,
                                    W_KIND, ALIGNED, BLOCK)
            carries = carries | tl.reduce(_carries(words, W_KIND), 0, _either)
        signs = 0x80000000 if W_KIND == F32 else 0x80008000
        bad = bad | tl.reduce((carries & signs) != 0, 0, _either).to(tl.int32)
    elif WHOLE:  # an address off 16 bytes: element by element, one block at a time
        for i in range(pid, whole, programs):
            bad = bad | _tile_nonfinite(table, grads, blocks, i, W_KIND, False, ALIGNED, BLOCK)
    if TAILS:
        for i in range(whole + pid, tiles, programs):
            bad = bad | _tile_nonfinite(table, grads, blocks, i, W_KIND, True, ALIGNED, BLOCK)
    # a reduction by a combine function of this module (tl.max is a @jit helper of
    # triton.language.standard: see the package docstring)
    tl.atomic_max(found, tl.reduce(bad, 0, _either).to(tl.float32))


@triton.jit
def _either(a, b):
    return a | b
