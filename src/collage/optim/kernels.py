"""One parameter's step: a rule's intended update landed by a strategy.

Two kernels, each generic over (rule, strategy); the strategy supplies the storage and
landing (``strategies/``), the rule the update (``rules.py``):

* :func:`fast_step` works in float32 registers: it loads the represented weight ``W`` (the
  pair summed in float32, the master, the decoded split master), computes
  ``W * decay + update`` in float32 and stores it back rounded into the strategy's
  components. The per-tensor, foreach, compiled (inductor, Triton) and native (C) paths all
  compute this, operation for operation.
* :func:`reference_step` is the research algorithm as it runs (``reference=True``): the
  rule's PyTorch operations on the stored states (each rounds once to their dtype) in the
  published code's order and AdamW form, then the strategy's landing, also in PyTorch
  operations.
"""

from __future__ import annotations

import torch

from .rules import Coeffs, Rule
from .strategies import Strategy

__all__ = ["fast_step", "reference_step", "represented_value"]


def fast_step(
    rule: Rule,
    strategy: Strategy,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    c: Coeffs,
    draws: torch.Tensor | None = None,
    want_intended: bool = False,
    intended_dtype: torch.dtype = torch.float64,
) -> torch.Tensor | None:
    """One step of one parameter in float32 registers.

    ``grad`` is float32 (already unscaled/negated by the caller); ``draws`` the draw key of
    a strategy that rounds stochastically (``draws.draw_key``), else None. Returns the
    intended update ``W * (decay - 1) + update`` in float64 when ``want_intended`` (for the
    metrics), or in ``intended_dtype`` (float32 for the CPU measured step, where float64
    conversions are slow: then the two products and the difference are each rounded to
    float32).
    """
    weight = strategy.load_weight(param, state)
    working = strategy.load_states(rule, state)
    decay, update, scale = rule.fast(weight, grad, working, c)
    intended = None
    if want_intended:
        wide_update = update.to(intended_dtype)
        if scale is not None:
            wide_update = wide_update * scale
        intended = wide_update - weight.to(intended_dtype) * c["lr_wd"]
    landed = strategy.land(param, state, weight, decay, c["lr_wd"], update, scale, draws)
    strategy.feed_back(rule, param, working, landed, c)
    strategy.store_states(rule, state, working, draws)
    return intended


def reference_step(
    rule: Rule,
    strategy: Strategy,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    c: Coeffs,
    draws: torch.Tensor | None = None,
    want_intended: bool = False,
) -> torch.Tensor | None:
    """One reference step (``c``: ``rule.reference_coefficients``). ``grad`` is in the
    states' dtype. Returns the intended update in float64 when asked: the raw update, and
    under the ``torch`` and ``HF`` weight-decay styles the decay applied beside it (before
    it: ``-lr_wd W``; after it: ``-lr_wd (W + raw)``), so that the metrics compare the
    whole intended change with the whole landed one."""
    style = c.get("weight_decay_style", "compact")
    decays = c.get("weight_decay", 0.0) > 0.0 and style in ("torch", "HF")
    before = represented_value(strategy, param, state) if want_intended and decays else None
    if decays and style == "torch":
        strategy.reference_decay(param, state, -c["lr_wd"])
    raw = strategy.reference_update(rule, param, grad, state, c, draws)
    landed = strategy.land_reference(param, state, raw, draws)
    strategy.feed_back(rule, param, state, landed, c)
    if decays and style == "HF":
        strategy.reference_decay(param, state, -c["lr_wd"])
    if not want_intended:
        return None
    intended = raw.double()
    if before is None:
        return intended
    if style == "HF":
        return intended - c["lr_wd"] * (before + intended)
    return intended - c["lr_wd"] * before


def represented_value(strategy: Strategy, param: torch.Tensor, state: dict) -> torch.Tensor:
    """The value the strategy represents, exactly, in float64.

    hi + lo of a pair, weight + Kahan compensation, the master for mixed and split; the
    weight itself otherwise. Exact: every sum here has at most 48 significant bits.
    """
    parts = strategy.represented_parts(param, state)
    value = parts[0].double()
    return value + parts[1].double() if len(parts) > 1 else value
