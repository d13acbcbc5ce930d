"""``mixed``: a low-precision model copy over float32 master weights and states (the (16, 32)
mixed-precision baseline)."""

from __future__ import annotations

import torch

from ... import mcf
from .strategy import Component, Strategy, axpy, is_one


class Mixed(Strategy):
    name = "mixed"
    summary = ("low-precision model copy, fp32 master weights and states "
               "(the (16, 32) baseline)")
    order = 1
    states_in_weight_dtype = False
    native_code = 1

    def weight_components(self, weight_dtype):
        # the model's copy is written from the master, never read by a step
        return (Component("param", weight_dtype, "weight", "w", read=False),
                Component("master", torch.float32, "master", "fp32 master"))

    def _new_component(self, component, param):
        if component.role == "master":
            return param.detach().to(torch.float32, copy=True)  # exact: widening
        return super()._new_component(component, param)

    def load_weight(self, param, state):
        return state["master"]

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        if not is_one(decay):
            weight.mul_(decay)
        weight.copy_(axpy(weight, update, scale))
        param.copy_(weight)  # round to nearest into the model's low-precision copy

    def reference_weight(self, param, state):
        return state["master"]

    def land_reference(self, param, state, raw, draws):
        state["master"].add_(raw)
        param.copy_(state["master"])

    def reference_decay(self, param, state, alpha):
        state["master"].add_(state["master"], alpha=alpha)
        param.copy_(state["master"])

    def represented_parts(self, param, state):
        return (state["master"],) if "master" in state else (param,)

    def set_from_full(self, param, state, value):
        state["master"].copy_(mcf.round_to(value, torch.float32))
        param.copy_(state["master"])


STRATEGY = Mixed()
