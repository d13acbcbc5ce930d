"""The non-finite check kernel, ``nonfinite_check``: a planned step's default check over the
step's own tiles, its verdict raised on the device."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _finite
from .codes import C_NUMEL, NCOL
from .columns import _pointer, _raw, _value


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
    # triton.language.standard: see the package docstring)
    tl.atomic_max(found, tl.reduce(bad, 0, _either).to(tl.float32))


@triton.jit
def _either(a, b):
    return a | b
