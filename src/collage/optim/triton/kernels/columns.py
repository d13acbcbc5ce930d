"""A stored component (a column of the launch table) in the kernels: its typed address, raw
loads, its values as float32, stores rounded to its dtype, and the MCF pairs' canonical
form (``strategy.residual``, ``strategy.normalize_pair``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _bf16_bits, _finite, _round, _widen
from .codes import BF16, F16, F32


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
