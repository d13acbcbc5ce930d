"""``stochastic``: the updated weight rounded stochastically to its dtype (unbiased), with
counter-based draws keyed by (seed, parameter position, step) on every path."""

from __future__ import annotations

from ..draws import uniforms
from ..rounding import stochastic_round
from .strategy import Strategy, axpy, is_one


class Stochastic(Strategy):
    name = "stochastic"
    summary = "stochastic rounding of the updated weight (seeded, resumable)"
    order = 4
    draws = True
    native_code = 4

    def land(self, param, state, weight, decay, lr_wd, update, scale, draws):
        new = axpy(weight if is_one(decay) else weight * decay, update, scale)
        param.copy_(stochastic_round(new, param.dtype, uniforms(draws, param.numel())))

    def land_reference(self, param, state, raw, draws):
        new = param.float() + raw.float()
        param.copy_(stochastic_round(new, param.dtype, uniforms(draws, param.numel())))


STRATEGY = Stochastic()
