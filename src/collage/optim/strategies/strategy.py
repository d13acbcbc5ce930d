"""What a precision strategy is: its stored components and the arithmetic that lands updates.

A :class:`Strategy` is the single definition of one way of storing a weight and its
optimizer states. It declares

* its **components** (:class:`Component`): every tensor kept per parameter, with its state
  key, dtype, role and bytes. The memory model (``collage memory``), the bytes a step moves
  (the benchmarks' roofline), the native kernels' tables, the validation of loaded states
  and the export all read this list;
* how its state is **created** (:meth:`Strategy.init_state`);
* how the weight is **read** as float32 (:meth:`Strategy.load_weight`) and how a float32
  update **lands** in the stored components (:meth:`Strategy.land`, the fast paths), and
  how a low-precision update lands op by op (:meth:`Strategy.land_reference`, the
  reference path);
* how the rule's states are read and written (:meth:`Strategy.load_states`,
  :meth:`Strategy.store_states`);
* what it **represents** exactly (:meth:`Strategy.represented_parts`) and how it is set from
  a full-precision value (:meth:`Strategy.set_from_full`): ``collage.consolidate``,
  ``collage.load_full_precision``, and a weight edited between steps (``optim/edits.py``:
  the components beside it set from it);
* its **native code** (the C kernels' strategy number), or None where it has none.

The subclasses in this package (one module per strategy) override only what differs from
these defaults, which describe a strategy whose rule states live in one tensor each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ... import mcf
from .. import research_mcf
from ..arith import axpy
from ..rules import RULES, Rule

__all__ = ["Component", "Strategy", "LOW_PRECISION", "residual", "normalize_pair", "axpy",
           "is_one", "dtype_name"]

#: weight dtypes the 16-bit strategies accept
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: roles of a component, and the memory model's column each is counted in
ROLE_COLUMNS = {
    "weight": "weights",        # the parameter itself (the model computes with it)
    "master": "weights",        # a float32 copy of the weight (mixed)
    "low": "compensation",      # low-order part of the weight: hi + lo, low bits
    "compensation": "compensation",  # Kahan's buffer of what the last add lost
    "moment": "optimizer_states",     # a rule state (Adam's m and v, momentum)
    "moment_low": "compensation",     # the low part of a slow EMA kept as a pair
    "scale": "optimizer_states",      # per-block scales of 8-bit states
}


@dataclass(frozen=True)
class Component:
    """One tensor a strategy keeps per parameter.

    ``key``: the state key (``"param"`` is the parameter itself); ``dtype``; ``role`` (see
    ``ROLE_COLUMNS``); ``label``: a short name for the memory table; ``per``: elements of
    the weight per stored element (1, or a block size for per-block scales); ``read``: a
    step reads it (every component is written; ``mixed``'s visible weight is only written).
    """

    key: str
    dtype: torch.dtype
    role: str
    label: str
    per: int = 1
    read: bool = True

    @property
    def bytes(self) -> float:
        """Bytes per weight element."""
        return torch.empty((), dtype=self.dtype).element_size() / self.per


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16``, ``fp32``, ``e4m3``...: the short names the docs and tables use."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.int16: "int16", torch.uint8: "u8", torch.float8_e4m3fn: "e4m3",
            torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype).replace("torch.", ""))


def residual(value: torch.Tensor, lead: torch.Tensor) -> torch.Tensor:
    """The non-finite rule of ``collage.mcf``: a trailing component is +0 where its leading
    component is inf/nan, so an overflow stays inf (``inf + (-inf)`` would be nan)."""
    return torch.where(torch.isfinite(lead), value, torch.zeros_like(value))


def normalize_pair(hi: torch.Tensor, lo: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair ``(hi, lo)`` in canonical form: ``hi`` is the round-to-nearest-even of
    ``hi + lo``, ``lo`` the exact rest (its value is unchanged).

    Why: a landing rounds the new value to ``hi`` and the rest to ``lo``; that rest can round
    up to exactly half of ``hi``'s ulp beside an odd ``hi`` (a tie ``hi + lo`` that rounds
    away from ``hi``), and Kahan's compensation can exceed half an ulp. Such a pair would
    flip at the next step even if it adds zero, moving the visible weight while the value
    stays. Canonical pairs do not: a zero update leaves them alone, bit for bit.

    ``hi + lo`` is exact in float32 for the residual landing's pairs (``light``, ``plus``, a
    pair-kept moment: proof in docs/strategies.md), and then so is the rest, which fits the
    component dtype (the error of a rounding to nearest does). Not for every Kahan pair: a
    compensation more than 16 binades below the weight can hold bits below float32's last
    place of ``hi + lo``, which the float32 sum drops (less than 2**-24 of the weight; the
    fast paths compute in float32 anyway). Non-finite ``hi`` keeps ``lo = +0``
    (``collage.mcf``'s rule)."""
    total = hi.float() + lo.float()
    nearest = total.to(hi.dtype)
    return nearest, residual(total - nearest.float(), nearest).to(lo.dtype)


def is_one(x) -> bool:
    """True for the Python number 1 (no decay); a 0-d tensor is never special-cased, and
    multiplying by it is exact anyway when it holds 1."""
    return not isinstance(x, torch.Tensor) and x == 1.0


class Strategy:
    """How one precision strategy stores a weight and its states, and lands an update.

    Class attributes (declared by each strategy):

    ``name``, ``summary``; ``order`` (its place in ``STRATEGIES``); ``weight_dtypes``: the
    model weight dtypes it accepts; ``states_in_weight_dtype``: rule states in the weight's
    dtype (else float32); ``mcf_slow_states``: a rule's slowly decaying EMA (Adam's second
    moment, Lion's momentum) is a pair ``(x, x_lo)``; ``rules``: the rules it supports
    (None: all); ``draws``: the strategy rounds with keyed uniform draws (``stochastic``,
    ``plus8``): its kernels take the draw key; ``native_code``: its number in the native C
    kernels, or None; ``opt_in``: not one of the main report's strategies, so compared and
    benchmarked only where named (``MAIN_STRATEGIES`` leaves it out).
    """

    name: str = ""
    summary: str = ""
    order: int = 0
    weight_dtypes: tuple[torch.dtype, ...] = LOW_PRECISION
    states_in_weight_dtype: bool = True
    mcf_slow_states: bool = False
    rules: frozenset[str] | None = None
    draws: bool = False
    native_code: int | None = None
    opt_in: bool = False

    # ------------------------------------------------------------------ layout

    def state_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the rule's states: float32 unless ``states_in_weight_dtype``; then
        the weight dtype for bf16 weights, and bf16 for fp16 weights, because fp16's range
        cannot hold Adam's second moment (``g**2`` underflows for ``|g| < 2**-12``, and eps
        = 1e-8 rounds to 0)."""
        if not self.states_in_weight_dtype:
            return torch.float32
        return torch.bfloat16 if weight_dtype == torch.float16 else weight_dtype

    def weight_components(self, weight_dtype: torch.dtype) -> tuple[Component, ...]:
        """The parameter and what is kept beside it (a master, a low part, a buffer)."""
        return (Component("param", weight_dtype, "weight", "w"),)

    def state_components(self, rule: Rule, weight_dtype: torch.dtype
                         ) -> tuple[Component, ...]:
        """The rule's states: one tensor each, and a low part for a slow EMA under
        ``mcf_slow_states``."""
        dtype = self.state_dtype(weight_dtype)
        out = []
        for spec in rule.states:
            out.append(Component(spec.name, dtype, "moment", spec.label))
            if spec.slow and self.mcf_slow_states:
                out.append(Component(spec.name + "_lo", dtype, "moment_low",
                                     spec.label + " lo"))
        return tuple(out)

    def components(self, rule: Rule, weight_dtype: torch.dtype | None = None
                   ) -> tuple[Component, ...]:
        """Every tensor kept per parameter (the parameter first); ``weight_dtype`` defaults
        to the first accepted dtype."""
        weight_dtype = weight_dtype or self.weight_dtypes[0]
        key = (rule.name, weight_dtype)
        cache = self.__dict__.setdefault("_components", {})
        if key not in cache:
            cache[key] = (self.weight_components(weight_dtype)
                          + self.state_components(rule, weight_dtype))
        return cache[key]

    def check_rule(self, rule: Rule) -> None:
        """A ValueError where this strategy does not support ``rule``."""
        if self.rules is not None and rule.name not in self.rules:
            allowed = ", ".join(RULES[name].title for name in sorted(self.rules))
            raise ValueError(f"strategy {self.name!r} supports {allowed} only, not "
                             f"{rule.title}; use 'plus'")

    # ------------------------------------------------------------------ state

    def init_state(self, rule: Rule, param: torch.Tensor, state: dict) -> None:
        """Create a parameter's state: the step counter and every component but the
        parameter, zero (a master is an exact copy of the weight)."""
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for component in self.components(rule, param.dtype):
            if component.key != "param":
                state[component.key] = self._new_component(component, param)

    def _new_component(self, component: Component, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param, dtype=component.dtype,
                                memory_format=torch.preserve_format)

    def load_states(self, rule: Rule, state: Mapping) -> dict[str, torch.Tensor]:
        """The rule's states as float32 working tensors: the stored tensor itself when it
        is float32 (updated in place), a pair as ``x + x_lo`` in float32 (rounded once where
        the pair spans more than float32's 24 bits)."""
        working = {}
        for spec in rule.states:
            value = state[spec.name]
            if spec.slow and self.mcf_slow_states:
                working[spec.name] = value.float() + state[spec.name + "_lo"].float()
            else:
                working[spec.name] = value if value.dtype == torch.float32 else value.float()
        return working

    def store_states(self, rule: Rule, state: Mapping, working: Mapping, draws) -> None:
        """Write the working states back: rounded to nearest, a pair's low part the exact
        residual (float32 subtraction of nearby values: exact, rounded once to the
        component dtype)."""
        for spec in rule.states:
            stored, value = state[spec.name], working[spec.name]
            if stored is value:
                continue  # float32 state updated in place
            stored.copy_(value)
            if spec.slow and self.mcf_slow_states:
                low = residual(value - stored.float(), stored).to(stored.dtype)
                hi, lo = normalize_pair(stored, low)
                stored.copy_(hi)
                state[spec.name + "_lo"].copy_(lo)

    def moment_value(self, rule: Rule, state: Mapping, name: str) -> torch.Tensor:
        """A rule state's represented value in float64 (``x + x_lo`` for a pair): what the
        metrics and the reports read."""
        value = state[name].double()
        if name + "_lo" in state:
            value = value + state[name + "_lo"].double()
        return value

    # ------------------------------------------------------------------ the update

    def load_weight(self, param: torch.Tensor, state: Mapping) -> torch.Tensor:
        """The represented weight in float32 (may alias a float32 stored tensor)."""
        return param.float()

    def land(self, param: torch.Tensor, state: Mapping, weight: torch.Tensor, decay,
             lr_wd, update: torch.Tensor, scale, draws) -> None:
        """Store ``weight * decay + update * scale`` (float32) into the components.

        ``lr_wd`` is ``1 - decay`` computed in float64 on the host (``decay - 1`` in float32
        would lose the digits of a small weight decay); ``draws``: the draw key (int32
        ``[key0, key1, first index]``) of a strategy with ``draws``, else None. Returns
        what :meth:`feed_back` needs (None but for a strategy that feeds back)."""
        raise NotImplementedError

    def feed_back(self, rule: Rule, param: torch.Tensor, states: dict, landed,
                  coeffs: Mapping) -> None:
        """After a landing: fold what it did not store into the rule's states (the
        ``feedback`` strategy); ``landed`` is what :meth:`land` or :meth:`land_reference`
        returned. Nothing by default."""

    # ------------------------------------------------------------------ the reference path

    def reference_weight(self, param: torch.Tensor, state: Mapping) -> torch.Tensor:
        """The weight the reference rule's decay term multiplies (the research code's ``p``:
        the visible weight; a master where the strategy keeps one)."""
        return param

    def reference_update(self, rule: Rule, param: torch.Tensor, grad: torch.Tensor,
                         state: Mapping, coeffs: Mapping, draws) -> torch.Tensor:
        """The rule's raw update, with PyTorch operations on the stored states (``grad`` in
        their dtype); the states are updated in place."""
        return rule.reference(self.reference_weight(param, state), grad, state, coeffs,
                              self.reference_slow_ema)

    def reference_slow_ema(self, states: dict, name: str, beta: float, plain, increment
                           ) -> None:
        """A slow EMA on the reference path: one tensor, or under ``mcf_slow_states`` a pair
        scaled by the split beta and grown by the increment (``research_mcf``: Collage-plus's
        arithmetic, its three defects fixed)."""
        if not self.mcf_slow_states:
            plain(states[name])
            return
        hi, lo = states[name], states[name + "_lo"]
        research_mcf.scale_pair(hi, lo, *research_mcf.split_beta(beta, hi))
        research_mcf.add_to_pair(hi, lo, increment())

    def land_reference(self, param: torch.Tensor, state: Mapping, raw: torch.Tensor,
                       draws) -> None:
        """Land the raw update (a tensor of the states' dtype) with PyTorch operations."""
        raise NotImplementedError

    def reference_decay(self, param: torch.Tensor, state: Mapping, alpha: float) -> None:
        """``w += alpha * w`` (AdamW's ``torch`` and ``HF`` weight-decay styles on the
        reference path): the research code's ``p.add_(p, alpha=-lr * wd)``."""
        param.add_(param, alpha=alpha)

    # ------------------------------------------------------------------ what it represents

    def represented_parts(self, param: torch.Tensor, state: Mapping
                          ) -> tuple[torch.Tensor, ...]:
        """The components whose exact sum is the represented value, each exact in float32
        (the weight alone before the state exists)."""
        return (param,)

    def compensation_of(self, state: Mapping) -> torch.Tensor | None:
        """The low-order tensor kept beside the weight, if any (for the metrics)."""
        return None

    def set_from_full(self, param: torch.Tensor, state: Mapping, value: torch.Tensor) -> None:
        """Set the weight's components from a float64 ``value`` as exactly as they can hold
        it (the inverse of the represented value)."""
        param.copy_(mcf.round_to(value, param.dtype))

    # ------------------------------------------------------------------ checks

    def check_group(self, rule: Rule, group: Mapping) -> None:
        """A ValueError where the group's hyperparameters do not suit this strategy."""

    def state_mismatch(self, rule: Rule, param: torch.Tensor, state: Mapping) -> str | None:
        """What makes ``state`` not this strategy's state of ``param`` (a missing component,
        a dtype, shape or device that does not match), or None where it matches. Cheap: no
        tensor data is read."""
        if param.dtype not in self.weight_dtypes:
            return f"the weight is {param.dtype}"
        for component in self.components(rule, param.dtype):
            if component.key == "param":
                continue
            have = state.get(component.key)
            if not isinstance(have, torch.Tensor):
                return f"{component.key!r} is missing"
            numel = param.numel() if component.per == 1 else -(-param.numel() // component.per)
            if have.dtype != component.dtype:
                return f"{component.key!r} is {have.dtype}, not {component.dtype}"
            if (tuple(have.shape) != tuple(param.shape) if component.per == 1
                    else have.numel() != numel):
                return (f"{component.key!r} has shape {tuple(have.shape)}, the weight "
                        f"{tuple(param.shape)}")
            if have.device != param.device:
                return f"{component.key!r} is on {have.device}, the weight on {param.device}"
        return None

    def matches(self, rule: Rule, param: torch.Tensor, state: Mapping) -> bool:
        """Whether ``state`` holds exactly this strategy's components for ``param``."""
        if self.state_mismatch(rule, param, state) is not None:
            return False
        keys = {c.key for c in self.components(rule, param.dtype)} - {"param"}
        return set(state) - {"step"} == keys

    # ------------------------------------------------------------------ derived facts

    def separate_visible(self, rule: Rule) -> bool:
        """Whether the visible weight is a different value from the represented one."""
        return any(c.role in ("master", "low", "compensation")
                   for c in self.weight_components(self.weight_dtypes[0]))

    def elementwise(self, rule: Rule) -> bool:
        """Whether every component is shaped like the weight (no per-block tensors)."""
        return all(c.per == 1 for c in self.components(rule))

    def __repr__(self) -> str:
        return f"<strategy {self.name!r}>"
