"""The update rules in the kernels (``rule.fast``): AdamW's, SGD's and Lion's update from
float32 values, in the eager path's operations and order."""

from __future__ import annotations

import triton
import triton.language as tl

from .arithmetic import _div_by_row, _fma, _lerp


@triton.jit
def _adamw(g, m, v, c0, c1, c2, c3, c4, c5, EMULATE_FMA: tl.constexpr):
    """AdamW's moments and update (k: one_minus_beta1, beta2, one_minus_beta2,
    bias_correction2_sqrt, eps, step_size), in the eager path's operations and order.

    ``sqrt(v) / c3`` divides by a per-row constant: by its reciprocal, computed once a
    tile, and one correction (:func:`_div_by_row`, the same bits: ``sqrt(v)`` is never
    subnormal and ``c3 = sqrt(1 - beta2**step)`` lies in ``(0, 1]``). The update's
    division, by each element's ``denom``, stays the IEEE one (``tl.div_rn``)."""
    m = _lerp(m, g, c0, EMULATE_FMA)
    v = _fma(g * c2, g, v * c1, EMULATE_FMA)
    denom = _div_by_row(tl.sqrt_rn(v), c3, tl.div_rn(1.0, c3), EMULATE_FMA) + c4
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
