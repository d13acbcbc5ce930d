"""``bf16``: low-precision weights and states, one rounded add (the lossy baseline)."""

from __future__ import annotations

from .strategy import Strategy, axpy, is_one


class BF16(Strategy):
    name = "bf16"
    summary = "low-precision weights and states, plain rounded add (lossy baseline)"
    order = 2
    native_code = 2

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        param.copy_(axpy(weight if is_one(decay) else weight * decay, update, scale))

    def land_reference(self, param, state, raw, draws):
        param.add_(raw.to(param.dtype))


STRATEGY = BF16()
