"""Per-parameter step kernels: a rule's intended update landed by a strategy.

State layout per parameter (``state`` dict of one parameter):

======================  ==============================================================
``step``                float32 0-d tensor (as torch.optim)
rule states             e.g. ``exp_avg``, ``exp_avg_sq``: float32 for fp32/mixed, else
                        the weight dtype; a slow EMA under plus/split also has ``<name>_lo``
``master``              mixed: float32 master weight
``compensation``        kahan: what the last rounded add lost, weight dtype
``weight_lo``           light/plus: low component of the (weight, weight_lo) MCF pair
``weight_low_bits``     split: int16, the 16 low bits of the float32 master
======================  ==============================================================

The *fast* kernel works in float32 registers: it loads the represented value ``W`` (the
MCF pair summed in float32, the master, the decoded split master), computes
``W * decay + update`` in float32, and stores it back rounded into the strategy's
components. The *reference* kernel does the rule's arithmetic op by op in the weight dtype.
"""

from __future__ import annotations

import torch

from .. import mcf
from .rounding import LowpArith, split_decode, split_encode, stochastic_round
from .rules import Coeffs, Rule
from .strategies import Strategy

__all__ = [
    "init_state",
    "fast_step",
    "reference_step",
    "represented_value",
    "compensation_of",
    "state_dtype",
]


def state_dtype(strategy: Strategy, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a rule's states: float32 for fp32/mixed; the weight dtype for bf16
    weights; and bf16 for fp16 weights, because fp16's range cannot hold Adam's second
    moment (``g**2`` underflows for ``|g| < 2**-12``, and eps = 1e-8 rounds to 0)."""
    if not strategy.states_in_weight_dtype:
        return torch.float32
    return torch.bfloat16 if weight_dtype == torch.float16 else weight_dtype


def init_state(rule: Rule, strategy: Strategy, param: torch.Tensor, state: dict) -> None:
    """Create a parameter's state for ``rule`` under ``strategy`` (zeros; exact copies)."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    dtype = state_dtype(strategy, param.dtype)
    for spec in rule.states:
        state[spec.name] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        if spec.slow and strategy.mcf_slow_states:
            state[spec.name + "_lo"] = torch.zeros_like(state[spec.name])
    if strategy.extra == "master":
        state["master"] = param.detach().to(torch.float32, copy=True)
    elif strategy.extra == "compensation":
        state["compensation"] = torch.zeros_like(param)
    elif strategy.extra == "weight_lo":
        state["weight_lo"] = torch.zeros_like(param)
    elif strategy.extra == "weight_low_bits":
        state["weight_low_bits"] = torch.zeros_like(param, dtype=torch.int16)


# ---------------------------------------------------------------------------------------
# float32-register path
# ---------------------------------------------------------------------------------------


def _load_weight(strategy: Strategy, param: torch.Tensor, state: dict) -> torch.Tensor:
    """The represented value in float32 (aliases the stored tensor for fp32 and mixed)."""
    name = strategy.name
    if name == "fp32":
        return param
    if name == "mixed":
        return state["master"]
    if name in ("light", "plus"):
        # Rounded to float32 when lo has bits below float32's last place (error <= 2**-24).
        return param.float() + state["weight_lo"].float()
    if name == "split":
        return split_decode(param, state["weight_low_bits"])
    return param.float()  # bf16, kahan (compensation handled when landing), stochastic


def _axpy(base: torch.Tensor, update: torch.Tensor, scale) -> torch.Tensor:
    """``base + update * scale`` with one rounding (a fused multiply-add, like torch's
    ``add(x, alpha=s)``); ``scale`` None means 1, a 0-d tensor comes from the compiled path."""
    if scale is None:
        return base + update
    if isinstance(scale, torch.Tensor):
        return torch.addcmul(base, update, scale.to(base.dtype))
    return torch.add(base, update, alpha=scale)


def _land(strategy: Strategy, param, state, weight, decay, lr_wd, update, generator) -> None:
    """Write ``weight * decay + update * scale`` (float32) into the strategy's components
    (``update`` is the ``(update, scale)`` pair a rule returns).

    ``lr_wd`` is ``1 - decay`` computed in float64 on the host (``decay - 1`` in float32
    would lose the digits of a small weight decay)."""
    name = strategy.name
    update, scale = update
    if name in ("fp32", "mixed"):
        if not _is_one(decay):
            weight.mul_(decay)
        weight.copy_(_axpy(weight, update, scale))
        if name == "mixed":
            param.copy_(weight)  # round to nearest into the model's low-precision copy
        return
    if name == "kahan":
        comp = state["compensation"]
        increment = _axpy(-weight * lr_wd if not _is_one(decay) else
                          torch.zeros_like(weight), update, scale)
        corrected = increment + comp.float()
        param.copy_(weight + corrected)
        # what this rounded add failed to land; float32 subtraction of nearby values: exact
        comp.copy_(_residual(corrected - (param.float() - weight), param))
        return
    new = _axpy(weight if _is_one(decay) else weight * decay, update, scale)
    if name == "bf16":
        param.copy_(new)
    elif name == "stochastic":
        param.copy_(stochastic_round(new, param.dtype, generator))
    elif name in ("light", "plus"):
        param.copy_(new)
        state["weight_lo"].copy_(_residual(new - param.float(), param))  # exact, rounded once
    elif name == "split":
        weight_bits, low_bits = split_encode(new)
        param.copy_(weight_bits)
        state["weight_low_bits"].copy_(low_bits)
    else:  # pragma: no cover - guarded by get_strategy
        raise AssertionError(name)


def _residual(residual: torch.Tensor, lead: torch.Tensor) -> torch.Tensor:
    """The non-finite rule of ``collage.mcf``: a trailing component is +0 where its leading
    component is inf/nan, so an overflow stays inf (``inf + (-inf)`` would be nan)."""
    return torch.where(torch.isfinite(lead), residual, torch.zeros_like(residual))


def _is_one(x) -> bool:
    """True for the Python number 1 (no decay); a 0-d tensor is never special-cased, and
    multiplying by it is exact anyway when it holds 1."""
    return not isinstance(x, torch.Tensor) and x == 1.0


def _load_states(rule: Rule, strategy: Strategy, state: dict) -> dict[str, torch.Tensor]:
    working = {}
    for spec in rule.states:
        value = state[spec.name]
        if spec.slow and strategy.mcf_slow_states:
            working[spec.name] = value.float() + state[spec.name + "_lo"].float()
        else:
            working[spec.name] = value if value.dtype == torch.float32 else value.float()
    return working


def _store_states(rule: Rule, strategy: Strategy, state: dict, working: dict) -> None:
    for spec in rule.states:
        stored, value = state[spec.name], working[spec.name]
        if stored is value:
            continue  # float32 state updated in place
        stored.copy_(value)
        if spec.slow and strategy.mcf_slow_states:
            state[spec.name + "_lo"].copy_(_residual(value - stored.float(), stored))


def fast_step(
    rule: Rule,
    strategy: Strategy,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    c: Coeffs,
    generator: torch.Generator | None = None,
    want_intended: bool = False,
) -> torch.Tensor | None:
    """One step of one parameter in float32 registers.

    ``grad`` is float32 (already unscaled/negated by the caller). Returns the intended update
    ``W * (decay - 1) + update`` in float64 when ``want_intended`` (for the metrics).
    """
    weight = _load_weight(strategy, param, state)
    working = _load_states(rule, strategy, state)
    decay, update, scale = rule.fast(weight, grad, working, c)
    intended = None
    if want_intended:
        wide_update = update.double() if scale is None else update.double() * scale
        intended = wide_update - weight.double() * c["lr_wd"]
    _land(strategy, param, state, weight, decay, c["lr_wd"], (update, scale), generator)
    _store_states(rule, strategy, state, working)
    return intended


# ---------------------------------------------------------------------------------------
# reference path: op by op in the weight's dtype
# ---------------------------------------------------------------------------------------


def _land_reference(strategy: Strategy, param, state, delta, generator) -> None:
    """Land the low-precision update ``delta`` with the strategy's own arithmetic."""
    ar = LowpArith(param.dtype)
    name = strategy.name
    if name == "bf16":
        param.copy_(ar.add(param, delta))
    elif name == "kahan":
        comp = state["compensation"]
        corrected = ar.add(delta, comp)
        total = ar.add(param, corrected)
        comp.copy_(_residual(ar.sub(corrected, ar.sub(total, param)), total))
        param.copy_(total)
    elif name == "stochastic":
        exact = param.double() + delta.double()  # exact: two 8/11-bit values, float64
        param.copy_(stochastic_round(exact, param.dtype, generator))
    elif name in ("light", "plus"):
        hi, lo = mcf.grow(param, state["weight_lo"], delta)
        param.copy_(hi)
        state["weight_lo"].copy_(lo)
    elif name == "split":
        master = split_decode(param, state["weight_low_bits"])
        new = mcf.round_to(master.double() + delta.double(), torch.float32)  # one fp32 add
        weight_bits, low_bits = split_encode(new)
        param.copy_(weight_bits)
        state["weight_low_bits"].copy_(low_bits)
    else:  # pragma: no cover
        raise AssertionError(name)


def reference_step(
    rule: Rule,
    strategy: Strategy,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    c: Coeffs,
    generator: torch.Generator | None = None,
    want_intended: bool = False,
) -> torch.Tensor | None:
    """One step, paper-faithful: every operation rounded to the weight dtype.

    ``grad`` is in the weight dtype. fp32 and mixed compute in float32 natively, so their
    reference *is* the fast kernel. Returns the rounded update in float64 when asked.
    """
    if strategy.name in ("fp32", "mixed"):
        return fast_step(rule, strategy, param, grad.float(), state, c, generator, want_intended)
    # The rule computes in its states' dtype (bf16 for fp16 weights, see state_dtype); the
    # update then lands in the weight's dtype.
    ar = LowpArith(state_dtype(strategy, param.dtype))
    states = {name: state[name] for name in _rule_state_keys(rule, strategy)}
    delta = rule.reference(ar, param, mcf.round_to(grad, ar.dtype), states, c,
                           strategy.mcf_slow_states)
    for name, value in states.items():
        state[name].copy_(value)
    delta = mcf.round_to(delta, param.dtype)
    _land_reference(strategy, param, state, delta, generator)
    return delta.double() if want_intended else None


def _rule_state_keys(rule: Rule, strategy: Strategy) -> list[str]:
    keys = []
    for spec in rule.states:
        keys.append(spec.name)
        if spec.slow and strategy.mcf_slow_states:
            keys.append(spec.name + "_lo")
    return keys


# ---------------------------------------------------------------------------------------
# what a strategy represents (metrics, export)
# ---------------------------------------------------------------------------------------


def represented_value(strategy: Strategy, param: torch.Tensor, state: dict) -> torch.Tensor:
    """The value the strategy represents, exactly, in float64.

    hi + lo of an MCF pair, weight + Kahan compensation, the master for mixed and split; the
    weight itself otherwise. Exact: every sum here has at most 48 significant bits.
    """
    name = strategy.name
    if name == "mixed" and "master" in state:
        return state["master"].double()
    if name in ("light", "plus") and "weight_lo" in state:
        return param.double() + state["weight_lo"].double()
    if name == "kahan" and "compensation" in state:
        return param.double() + state["compensation"].double()
    if name == "split" and "weight_low_bits" in state:
        return split_decode(param, state["weight_low_bits"]).double()
    return param.double()


def compensation_of(strategy: Strategy, state: dict) -> torch.Tensor | None:
    """The low-order tensor a strategy keeps beside the weight, if any (for the metrics)."""
    return state.get("weight_lo", state.get("compensation"))
