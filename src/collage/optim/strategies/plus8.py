"""``plus8``: Collage-light's weight, and Adam's moments in 8-bit block-scaled formats
rounded stochastically: ``m`` one e4m3 byte, ``v`` an e5m2 byte plus 8 low bits, each with a
float32 scale per block of 128 (``optim/eight_bit.py``, ``docs/eight_bit.md``). AdamW only.
"""

from __future__ import annotations

import torch

from ... import mcf
from .. import eight_bit
from ..draws import uniforms
from .plus import Plus
from .strategy import Component

# int32 salt of the second moment's uniforms (the first moment uses salt 0)
_SECOND_MOMENT_SALT = 0x2545F491


class Plus8(Plus):
    name = "plus8"
    summary = ("Collage-light weights; m in 1 byte (e4m3), v in 2 (e5m2 + 8 low bits), "
               "block-scaled, stochastically rounded (AdamW only)")
    order = 8
    weight_dtypes = (torch.bfloat16,)
    rules = frozenset({"adamw"})
    draws = True
    native_code = None
    opt_in = True

    def state_components(self, rule, weight_dtype):
        block = eight_bit.BLOCK
        return (Component("exp_avg", eight_bit.CODE_DTYPE, "moment", "m"),
                Component("exp_avg_scale", torch.float32, "scale", "m scale", per=block),
                Component("exp_avg_sq", eight_bit.HI_DTYPE, "moment", "v"),
                Component("exp_avg_sq_lo", eight_bit.LO_DTYPE, "moment_low", "v lo"),
                Component("exp_avg_sq_scale", torch.float32, "scale", "v scale", per=block))

    def init_state(self, rule, param, state):
        if hasattr(param, "device_mesh"):  # per-block scales are not laid out like the weight
            raise ValueError("strategy 'plus8' does not support sharded (DTensor / FSDP2) "
                             "parameters yet: its per-block scales cannot be sharded like "
                             "the weight; use 'plus' with FSDP2")
        super().init_state(rule, param, state)

    def _new_component(self, component, param):
        if component.role == "scale":  # one power-of-two scale per block, starting at 1
            return torch.ones(eight_bit.n_blocks(param.numel()), dtype=torch.float32,
                              device=param.device)
        return torch.zeros(param.shape, dtype=component.dtype, device=param.device)

    def load_states(self, rule, state):
        return {
            "exp_avg": eight_bit.decode_q8(state["exp_avg"], state["exp_avg_scale"]),
            "exp_avg_sq": eight_bit.decode_pair11(state["exp_avg_sq"], state["exp_avg_sq_lo"],
                                                  state["exp_avg_sq_scale"]),
        }

    def store_states(self, rule, state, working, draws):
        n = state["exp_avg"].numel()
        code, scale = eight_bit.encode_q8(working["exp_avg"], _uniforms(n, draws, 0))
        state["exp_avg"].copy_(code)
        state["exp_avg_scale"].copy_(scale)
        hi, lo, scale = eight_bit.encode_pair11(working["exp_avg_sq"],
                                                _uniforms(n, draws, _SECOND_MOMENT_SALT))
        state["exp_avg_sq"].copy_(hi)
        state["exp_avg_sq_lo"].copy_(lo)
        state["exp_avg_sq_scale"].copy_(scale)

    def moment_value(self, rule, state, name):
        return {k: v.double() for k, v in self.load_states(rule, state).items()}[name]

    def reference_update(self, rule, param, grad, state, coeffs, draws):
        """AdamW's step, reference arithmetic; returns the bf16 update to land.

        Each moment is updated by its exact EMA (float64: products and sums of <= 12-bit
        values with float64 coefficients, error <= 2**-52 relative) rounded *once* into its
        8-bit format by the float64 encoder, with the same draws as the fast path. Op-by-op
        e4m3 arithmetic could not express the EMA at all (beta2 = 0.999 rounds to 1.0 in
        e4m3, and (1 - beta2) g**2 is below half an e4m3 spacing of v): one rounding per
        state update is what a float8 unit with a wide accumulator computes. The update is
        then computed from the moments of this step, each rounded once to bf16 (like the
        fast path, which uses the float32 moments before they are stored), with
        ``AdamWRule.reference``'s PyTorch operations and research form; the light landing
        lands it.
        """
        c, g = coeffs, grad.double()
        m = eight_bit.decode_q8_reference(state["exp_avg"], state["exp_avg_scale"])
        v = eight_bit.decode_pair11_reference(state["exp_avg_sq"], state["exp_avg_sq_lo"],
                                              state["exp_avg_sq_scale"])
        m = c["beta1"] * m + c["one_minus_beta1"] * g
        v = c["beta2"] * v + c["one_minus_beta2"] * (g * g)
        n = grad.numel()
        code, m_scale = eight_bit.encode_q8_reference(m, _uniforms(n, draws, 0))
        hi, lo, v_scale = eight_bit.encode_pair11_reference(
            v, _uniforms(n, draws, _SECOND_MOMENT_SALT))
        state["exp_avg"].copy_(code.view(param.shape))  # on the e4m3 grid: the cast is exact
        state["exp_avg_scale"].copy_(m_scale)
        state["exp_avg_sq"].copy_(hi.view(param.shape))
        state["exp_avg_sq_lo"].copy_(lo.view(param.shape))
        state["exp_avg_sq_scale"].copy_(v_scale)
        # the update uses this step's moments before storage
        m_b, v_b = mcf.round_to(m, torch.bfloat16), mcf.round_to(v, torch.bfloat16)
        denom = v_b.sqrt().add_(c["eps"])
        raw = -c["research_step_size"] * m_b / denom
        if c["weight_decay"] > 0.0 and c["weight_decay_style"] == "compact":
            raw = raw - c["lr_wd"] * param
        return raw


def _uniforms(n: int, draws: torch.Tensor | None, salt: int) -> torch.Tensor:
    """float32 uniforms for the stochastic rounding of one moment, one per element in
    row-major order, from the draw key every path passes (so all draw the same numbers for
    an element at a step)."""
    if draws is None:
        raise ValueError("plus8's step needs its draw key (draws.draw_key); got None")
    return uniforms(draws, n, salt)


STRATEGY = Plus8()
