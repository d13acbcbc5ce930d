"""Moving a parameter's state between strategies, and in from a ``torch.optim`` state.

One algorithm serves every pair of strategies (``docs/reliability.md`` has the table of
what it does for each): the weight the old state represents (exactly, in float64) is set
into the new strategy's components as exactly as they can hold it
(``Strategy.set_from_full``), and the rule's states are read as float32 (a pair summed, 8-bit
codes decoded) and stored the new strategy's way (``Strategy.store_states``: rounded to
nearest, a pair's low part the exact residual; plus8 rounds stochastically with the draws
of the parameter's position and current step). The step counter is kept. Nothing is lost
that the new layout can hold: ``bf16 -> plus`` adds zero low parts, ``plus -> light``
rounds ``v + v_lo`` into ``v``, ``mixed -> bf16`` rounds the master into the weight and
frees every float32 tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import draws as keyed
from . import kernels
from .group import local
from .rules import Rule
from .strategies import Strategy, all_strategies

__all__ = ["layout_of", "convert", "from_torch_state"]


def layout_of(rule: Rule, param: torch.Tensor, state: Mapping) -> Strategy | None:
    """A strategy whose layout ``state`` has exactly (strategies with the same layout, such
    as bf16 and stochastic, store the same values: any of them reads it the same)."""
    for strategy in all_strategies():
        if strategy.rules is None or rule.name in strategy.rules:
            if strategy.matches(rule, param, state):
                return strategy
    return None


def convert(rule: Rule, old: Strategy, new: Strategy, param: torch.Tensor, state: dict,
            seed: int, position: int) -> dict:
    """The state of ``param`` under ``new``, made from its ``state`` under ``old``; the
    parameter itself is rewritten (its weight as ``new`` holds it). ``state`` is left as
    it was, so the caller can install the result or drop it."""
    parts = _local_state(state)
    value = kernels.represented_value(old, local(param.detach()), parts)
    working = {name: tensor.float().clone()
               for name, tensor in old.load_states(rule, parts).items()}
    return _build(rule, new, param, state["step"], value, working, seed, position)


def from_torch_state(rule: Rule, new: Strategy, param: torch.Tensor, saved: Mapping,
                     current: Mapping, seed: int, position: int) -> dict:
    """Our state of ``param`` under ``new`` from a ``torch.optim`` state (its float32
    moments, its ``step``): the moments stored as ``new`` stores float32 values; the weight
    as ``current`` represents it (set by ``collage.load_full_precision`` before, say), else
    the parameter itself."""
    whole = local(param.detach())
    value = (kernels.represented_value(new, whole, _local_state(current))
             if new.matches(rule, param, current) else whole.double())
    working = {}
    for spec in rule.states:
        moment = saved.get(spec.name)
        working[spec.name] = (torch.zeros_like(whole, dtype=torch.float32) if moment is None
                              else local(moment).to(device=whole.device, dtype=torch.float32,
                                                    copy=True))
    step = saved.get("step", 1.0 if any(saved.get(s.name) is not None for s in rule.states)
                     else 0.0)
    step = torch.as_tensor(step, dtype=torch.float32).clone().reshape(())
    return _build(rule, new, param, step, value, working, seed, position)


def _build(rule: Rule, new: Strategy, param: torch.Tensor, step: torch.Tensor,
           value: torch.Tensor, working: dict, seed: int, position: int) -> dict:
    state: dict = {}
    new.init_state(rule, param, state)
    state["step"] = step.detach().to(torch.float32).clone()
    parts = _local_state(state)
    whole = local(param.detach())
    draws = None
    if new.draws:
        draws = keyed.draw_key(seed, position, int(state["step"].item()), 0, whole.device)
    with torch.no_grad():
        new.set_from_full(whole, parts, value)
        new.store_states(rule, parts, working, draws)
    return state


def _local_state(state: Mapping) -> dict:
    return {k: local(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
