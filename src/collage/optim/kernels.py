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
plus8 (AdamW only)      ``exp_avg`` float8_e4m3fn codes and ``exp_avg_scale`` (float32, one
                        per block of 128); ``exp_avg_sq`` e5m2, ``exp_avg_sq_lo`` uint8 and
                        ``exp_avg_sq_scale``; ``weight_lo`` as plus (see ``eight_bit.py``)
======================  ==============================================================

The *fast* kernel works in float32 registers: it loads the represented value ``W`` (the
MCF pair summed in float32, the master, the decoded split master), computes
``W * decay + update`` in float32, and stores it back rounded into the strategy's
components. The *reference* kernel does the rule's arithmetic op by op in the weight dtype.
"""

from __future__ import annotations

import torch

from .. import mcf
from . import eight_bit
from . import fused as _fused  # counter_uniform (fused imports us: looked up at call time)
from .rounding import LowpArith, split_decode, split_encode, stochastic_round
from .rules import Coeffs, Rule
from .strategies import Strategy

__all__ = [
    "init_state",
    "fast_step",
    "reference_step",
    "represented_value",
    "represented_parts",
    "compensation_of",
    "moment_value",
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
    if strategy.eight_bit:
        _init_eight_bit(param, state)
        return
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


def _init_eight_bit(param: torch.Tensor, state: dict) -> None:
    """plus8's state (AdamW only: checked when the optimizer validates its groups)."""
    if hasattr(param, "device_mesh"):  # per-block scales are not laid out like the weight
        raise ValueError("strategy 'plus8' does not support sharded (DTensor / FSDP2) "
                         "parameters yet: its per-block scales cannot be sharded like the "
                         "weight; use 'plus' with FSDP2")
    blocks = eight_bit.n_blocks(param.numel())

    def codes(dtype):
        return torch.zeros(param.shape, dtype=dtype, device=param.device)

    state["exp_avg"] = codes(eight_bit.CODE_DTYPE)
    state["exp_avg_scale"] = torch.ones(blocks, dtype=torch.float32, device=param.device)
    state["exp_avg_sq"] = codes(eight_bit.HI_DTYPE)
    state["exp_avg_sq_lo"] = codes(eight_bit.LO_DTYPE)
    state["exp_avg_sq_scale"] = torch.ones(blocks, dtype=torch.float32, device=param.device)
    state["weight_lo"] = torch.zeros_like(param)


# int32 salt of the second moment's uniforms (the first moment uses salt 0)
_SECOND_MOMENT_SALT = 0x2545F491


def _eight_bit_draws(seeds: torch.Tensor, grad: torch.Tensor, salt: int) -> torch.Tensor:
    """float32 uniforms for plus8's stochastic rounding, one per element in row-major order.

    ``seeds`` is ``fused.stochastic_seeds``'s key, (seed, parameter position, step, first
    element index): every path (reference, foreach, fused, measured or not) passes it, so
    all draw the same numbers for an element at a step.
    """
    if seeds is None:
        raise ValueError("plus8's step needs its draw key (fused.stochastic_seeds); got None")
    return _fused.counter_uniform(grad.numel(), seeds, salt)


def _load_eight_bit(state: dict) -> dict[str, torch.Tensor]:
    return {
        "exp_avg": eight_bit.decode_q8(state["exp_avg"], state["exp_avg_scale"]),
        "exp_avg_sq": eight_bit.decode_pair11(state["exp_avg_sq"], state["exp_avg_sq_lo"],
                                              state["exp_avg_sq_scale"]),
    }


def _store_eight_bit(state: dict, m: torch.Tensor, v: torch.Tensor, u_m, u_v) -> None:
    code, scale = eight_bit.encode_q8(m, u_m)
    state["exp_avg"].copy_(code)
    state["exp_avg_scale"].copy_(scale)
    hi, lo, scale = eight_bit.encode_pair11(v, u_v)
    state["exp_avg_sq"].copy_(hi)
    state["exp_avg_sq_lo"].copy_(lo)
    state["exp_avg_sq_scale"].copy_(scale)


def moment_value(strategy: Strategy, state: dict, name: str) -> torch.Tensor:
    """A rule state's represented value in float64 (decoded for plus8, hi + lo under an MCF
    strategy): what the metrics and the reports read."""
    if strategy.eight_bit:
        return {k: v.double() for k, v in _load_eight_bit(state).items()}[name]
    value = state[name].double()
    if name + "_lo" in state:
        value = value + state[name + "_lo"].double()
    return value


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
    if strategy.extra == "weight_lo":
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
    elif strategy.extra == "weight_lo":
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
    intended_dtype: torch.dtype = torch.float64,
) -> torch.Tensor | None:
    """One step of one parameter in float32 registers.

    ``grad`` is float32 (already unscaled/negated by the caller). Returns the intended update
    ``W * (decay - 1) + update`` in float64 when ``want_intended`` (for the metrics), or in
    ``intended_dtype`` (float32 for the CPU measured step, where float64 conversions are
    slow: then the two products and the difference are each rounded to float32).
    """
    weight = _load_weight(strategy, param, state)
    working = _load_eight_bit(state) if strategy.eight_bit else \
        _load_states(rule, strategy, state)
    decay, update, scale = rule.fast(weight, grad, working, c)
    intended = None
    if want_intended:
        wide_update = update.to(intended_dtype)
        if scale is not None:
            wide_update = wide_update * scale
        intended = wide_update - weight.to(intended_dtype) * c["lr_wd"]
    if strategy.eight_bit:  # generator: the int32 seeds of the draws (or None)
        draws = (_eight_bit_draws(generator, grad, 0),
                 _eight_bit_draws(generator, grad, _SECOND_MOMENT_SALT))
        generator = None
    _land(strategy, param, state, weight, decay, c["lr_wd"], (update, scale), generator)
    if strategy.eight_bit:
        _store_eight_bit(state, working["exp_avg"], working["exp_avg_sq"], *draws)
    else:
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
    elif strategy.extra == "weight_lo":
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
    if strategy.eight_bit:
        delta = _reference_eight_bit(param, grad, state, c, generator)
        _land_reference(strategy, param, state, delta, None)
        return delta.double() if want_intended else None
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


def _reference_eight_bit(param, grad, state, c: Coeffs, seeds) -> torch.Tensor:
    """plus8's AdamW step, reference arithmetic; returns the bf16 update to land.

    Each moment is updated by its exact EMA (float64: products and sums of <= 12-bit values
    with float64 coefficients, error <= 2**-52 relative) rounded *once* into its 8-bit format
    by the float64 encoder, with the same draws as the fast path. Op-by-op e4m3 arithmetic
    could not express the EMA at all (beta2 = 0.999 rounds to 1.0 in e4m3, and (1 - beta2) g**2
    is below half an e4m3 spacing of v): one rounding per state update is what a float8 unit
    with a wide accumulator computes. The update is then computed op by op in bf16 from the
    moments of this step, rounded once to bf16 (like the fast path, which uses the float32
    moments before they are stored), as ``AdamWRule.reference`` does, then landed with
    ``mcf.grow``.
    """
    from .rules import _reference_decay_term

    g = grad.double()
    m = eight_bit.decode_q8_reference(state["exp_avg"], state["exp_avg_scale"])
    v = eight_bit.decode_pair11_reference(state["exp_avg_sq"], state["exp_avg_sq_lo"],
                                          state["exp_avg_sq_scale"])
    m = c["beta1"] * m + c["one_minus_beta1"] * g
    v = c["beta2"] * v + c["one_minus_beta2"] * (g * g)
    g32 = grad.float()
    code, m_scale = eight_bit.encode_q8_reference(m, _eight_bit_draws(seeds, g32, 0))
    hi, lo, v_scale = eight_bit.encode_pair11_reference(
        v, _eight_bit_draws(seeds, g32, _SECOND_MOMENT_SALT))
    state["exp_avg"].copy_(code.view(param.shape))  # on the e4m3 grid: the cast is exact
    state["exp_avg_scale"].copy_(m_scale)
    state["exp_avg_sq"].copy_(hi.view(param.shape))
    state["exp_avg_sq_lo"].copy_(lo.view(param.shape))
    state["exp_avg_sq_scale"].copy_(v_scale)
    ar = LowpArith(torch.bfloat16)  # the update uses this step's moments before storage
    m_b, v_b = mcf.round_to(m, ar.dtype), mcf.round_to(v, ar.dtype)
    root = ar.div(ar.sqrt(v_b), ar.c(c["bias_correction2_sqrt"], m_b))
    denom = ar.add(root, ar.c(c["eps"], m_b))
    update = ar.div(ar.mul(ar.c(-c["step_size"], m_b), m_b), denom)
    return mcf.round_to(_reference_decay_term(ar, param, update, c).double(), param.dtype)


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
    parts = represented_parts(strategy, param, state)
    value = parts[0].double()
    return value + parts[1].double() if len(parts) > 1 else value


def represented_parts(strategy: Strategy, param: torch.Tensor, state: dict
                      ) -> tuple[torch.Tensor, ...]:
    """The components whose exact sum is the represented value, each exact in float32: the
    master (mixed, split), weight and low part (an MCF pair), weight and compensation
    (kahan), the weight alone otherwise or before the state exists."""
    name = strategy.name
    if name == "mixed" and "master" in state:
        return (state["master"],)
    if name == "split" and "weight_low_bits" in state:
        return (split_decode(param, state["weight_low_bits"]),)
    if strategy.extra == "weight_lo" and "weight_lo" in state:
        return (param, state["weight_lo"])
    if name == "kahan" and "compensation" in state:
        return (param, state["compensation"])
    return (param,)


def compensation_of(strategy: Strategy, state: dict) -> torch.Tensor | None:
    """The low-order tensor a strategy keeps beside the weight, if any (for the metrics)."""
    return state.get("weight_lo", state.get("compensation"))
