"""``fp32``: float32 weights and states, a plain float32 add: ``torch.optim`` bit for bit."""

from __future__ import annotations

import torch

from .strategy import Strategy, axpy, is_one


class FP32(Strategy):
    name = "fp32"
    summary = "fp32 weights and states; plain add (identical to torch.optim)"
    order = 0
    weight_dtypes = (torch.float32,)
    states_in_weight_dtype = False
    native_code = 0

    def load_weight(self, param, state):
        return param

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        # the same operations as torch.optim: decay in place, then one fused multiply-add
        if not is_one(decay):
            weight.mul_(decay)
        weight.copy_(axpy(weight, update, scale))

    def land_reference(self, param, state, raw, draws):
        param.add_(raw)


STRATEGY = FP32()
