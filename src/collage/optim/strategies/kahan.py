"""``kahan``: a Kahan-compensated add; a low-precision buffer keeps what each rounded add
lost and feeds it into the next one."""

from __future__ import annotations

import torch

from ... import mcf
from .strategy import Component, Strategy, axpy, normalize_pair, is_one, residual


class Kahan(Strategy):
    name = "kahan"
    summary = "Kahan-compensated update with a low-precision compensation buffer"
    order = 3
    native_code = 3

    def weight_components(self, weight_dtype):
        return (Component("param", weight_dtype, "weight", "w"),
                Component("compensation", weight_dtype, "compensation", "Kahan buffer"))

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        comp = state["compensation"]
        start = torch.zeros_like(weight) if is_one(decay) else -weight * lr_wd
        corrected = axpy(start, update, scale) + comp.float()
        param.copy_(weight + corrected)
        # what this rounded add failed to land (float32 subtraction of nearby values: exact
        # where |corrected| <= |weight|, Fast2Sum's condition; normalize_pair keeps the pair
        # canonical where it is not)
        lost = residual(corrected - (param.float() - weight), param).to(comp.dtype)
        self._store(param, comp, lost)

    @staticmethod
    def _store(param, comp, lost) -> None:
        hi, lo = normalize_pair(param, lost)
        param.copy_(hi)
        comp.copy_(lo)

    def land_reference(self, param, state, raw, draws):
        comp = state["compensation"]
        # raw + comp rounded once to the weight's dtype, as a PyTorch add of two tensors of
        # that dtype rounds (written out so that a buffer of another dtype rounds the same)
        corrected = (raw.float() + comp.float()).to(param.dtype)
        total = param + corrected
        lost = residual(corrected - (total - param), total)
        param.copy_(total)
        self._store(param, comp, lost)

    def represented_parts(self, param, state):
        return (param, state["compensation"]) if "compensation" in state else (param,)

    def compensation_of(self, state):
        return state.get("compensation")

    def set_from_full(self, param, state, value):
        param.copy_(mcf.round_to(value, param.dtype))
        state["compensation"].copy_(mcf.round_to(value - param.double(), param.dtype))


STRATEGY = Kahan()
