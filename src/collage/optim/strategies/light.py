"""``light`` (Collage-light): the weight as a two-component MCF ``(hi, lo)`` updated with
``Grow``, so updates below half an ulp of the weight accumulate in ``lo``."""

from __future__ import annotations

from ... import mcf
from .. import research_mcf
from .strategy import Component, Strategy, axpy, normalize_pair, is_one, residual


class Light(Strategy):
    name = "light"
    summary = "weight as a two-component MCF (hi, lo) updated with Grow (Collage-light)"
    order = 5
    native_code = 5

    def weight_components(self, weight_dtype):
        return (Component("param", weight_dtype, "weight", "w"),
                Component("weight_lo", weight_dtype, "low", "lo"))

    def load_weight(self, param, state):
        # rounded to float32 when lo has bits below float32's last place (error <= 2**-24)
        return param.float() + state["weight_lo"].float()

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        new = axpy(weight if is_one(decay) else weight * decay, update, scale)
        param.copy_(new)
        # float32 minus its nearest bf16: exact (Sterbenz), then rounded once into lo
        low = residual(new - param.float(), param).to(param.dtype)
        hi, lo = normalize_pair(param, low)
        param.copy_(hi)
        state["weight_lo"].copy_(lo)

    def land_reference(self, param, state, raw, draws):
        research_mcf.grow(param, state["weight_lo"], raw.to(param.dtype))

    def represented_parts(self, param, state):
        return (param, state["weight_lo"]) if "weight_lo" in state else (param,)

    def compensation_of(self, state):
        return state.get("weight_lo")

    def set_from_full(self, param, state, value):
        hi, lo = mcf.split(value, param.dtype, 2)
        param.copy_(hi)
        state["weight_lo"].copy_(lo)


STRATEGY = Light()
