"""The landings in the kernels (``strategy.load_weight`` and ``strategy.land``): the weight
read from its stored components and the new weight stored, per strategy (``LANDING``, its
``native_code``), and stochastic rounding's draws of a tile."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _axpy, _finite, _round
from .codes import (C_STEP, F32, L_BF16, L_FP32, L_LIGHT, L_MIXED, L_PLUS, L_SPLIT,
                    L_STOCHASTIC, NCOL)
from .columns import _normalize, _store, _store_pair, _value
from .draws import _draw16, _stochastic_bf16_draw16


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
        tl.store(w_ptr + offs, _stochastic_bf16_draw16(new, draw).to(tl.uint16), mask=mask)
    elif LANDING == L_SPLIT:
        # rounding.split_encode: the bf16 weight nearest the master, its low 16 bits
        # (a NaN master: its top half made quiet, never rounded)
        bits = new.to(tl.uint32, bitcast=True)
        low = bits & 0xFFFF
        top = bits >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        top = tl.where(nan, top | 0x40, top + (low > 0x8000).to(tl.uint32))
        tl.store(w_ptr + offs, top.to(tl.uint16), mask=mask)
        tl.store(x_ptr + offs, low.to(tl.uint16), mask=mask)
    else:
        # L_LIGHT, L_PLUS: the new weight as a pair (hi, lo)
        _store_pair(w_ptr, x_ptr, offs, new, mask, W_KIND, HW)


@triton.jit
def _draw(table, row, step, offs, LANDING: tl.constexpr, CAPTURABLE: tl.constexpr):
    """Stochastic rounding's draws of the tile, the top 16 of their 24 bits
    (:func:`_draw16`: all the rounding reads of them); 0 for the other landings."""
    if LANDING == L_STOCHASTIC:
        row_base = table + row * NCOL
        if CAPTURABLE:
            counter = tl.load(row_base + C_STEP).to(tl.pointer_type(tl.float32))
            return _draw16(row_base, tl.load(counter).to(tl.int64), offs)
        else:
            return _draw16(row_base, step.to(tl.int64), offs)
    else:
        return tl.full(offs.shape, 0, tl.uint32)
