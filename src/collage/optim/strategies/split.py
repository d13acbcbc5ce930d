"""``split``: a bf16 weight plus the 16 low bits of a float32 master: the update is an exact
float32 add, at 12 bytes."""

from __future__ import annotations

import torch

from ... import mcf
from ..rounding import split_decode, split_encode
from .strategy import Component, Strategy, axpy, is_one


class Split(Strategy):
    name = "split"
    summary = "bf16 weight plus the 16 low bits of an fp32 master: exact fp32 update"
    order = 7
    weight_dtypes = (torch.bfloat16,)  # bf16 is exactly the top half of a float32
    mcf_slow_states = True
    native_code = 7

    def weight_components(self, weight_dtype):
        return (Component("param", weight_dtype, "weight", "w"),
                Component("weight_low_bits", torch.int16, "low", "low 16 bits"))

    def load_weight(self, param, state):
        return split_decode(param, state["weight_low_bits"])

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        self._store(param, state, axpy(weight if is_one(decay) else weight * decay,
                                       update, scale))

    def reference_weight(self, param, state):
        return split_decode(param, state["weight_low_bits"])

    def land_reference(self, param, state, raw, draws):
        master = split_decode(param, state["weight_low_bits"])
        self._store(param, state, master.add_(raw.float()))  # one float32 add

    def reference_decay(self, param, state, alpha):
        master = split_decode(param, state["weight_low_bits"])
        self._store(param, state, master.add_(master, alpha=alpha))

    @staticmethod
    def _store(param, state, master: torch.Tensor) -> None:
        weight_bits, low_bits = split_encode(master)
        param.copy_(weight_bits)
        state["weight_low_bits"].copy_(low_bits)

    def represented_parts(self, param, state):
        if "weight_low_bits" not in state:
            return (param,)
        return (split_decode(param, state["weight_low_bits"]),)

    def set_from_full(self, param, state, value):
        self._store(param, state, mcf.round_to(value, torch.float32))


STRATEGY = Split()
