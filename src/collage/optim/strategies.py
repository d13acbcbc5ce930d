"""Precision strategies: how weights and optimizer states are stored, and how updates land.

An update rule (AdamW, SGD, Lion) computes the *intended* update; the strategy named here
decides the storage of the weight, of its compensation term and of the rule's states, and the
arithmetic that lands the update. The names are public API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["STRATEGIES", "Strategy", "get_strategy", "check_weight"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Strategy:
    """What one precision strategy stores.

    ``weight_dtypes``: the model weight dtypes it accepts. ``states_in_weight_dtype``: rule
    states (moments) are stored in the weight's dtype (else float32). ``mcf_slow_states``: the
    rule's slowly decaying EMA (Adam's second moment, Lion's momentum) is a two-component
    expansion ``(x, x_lo)`` so that updates of size ``(1 - beta) * x`` are not rounded away.
    ``extra``: the per-weight tensor kept beside the weight, if any. ``eight_bit``: Adam's
    moments are block-scaled float8 codes rounded stochastically (``optim/eight_bit.py``;
    AdamW only).
    """

    name: str
    weight_dtypes: tuple[torch.dtype, ...]
    states_in_weight_dtype: bool
    mcf_slow_states: bool
    extra: str | None
    summary: str
    eight_bit: bool = False


_ALL = (
    Strategy("fp32", (torch.float32,), False, False, None,
             "fp32 weights and states; plain add (identical to torch.optim)"),
    Strategy("mixed", LOW_PRECISION, False, False, "master",
             "low-precision model copy, fp32 master weights and states (the (16, 32) baseline)"),
    Strategy("bf16", LOW_PRECISION, True, False, None,
             "low-precision weights and states, plain rounded add (lossy baseline)"),
    Strategy("kahan", LOW_PRECISION, True, False, "compensation",
             "Kahan-compensated update with a low-precision compensation buffer"),
    Strategy("stochastic", LOW_PRECISION, True, False, None,
             "stochastic rounding of the updated weight (seeded, resumable)"),
    Strategy("light", LOW_PRECISION, True, False, "weight_lo",
             "weight as a two-component MCF (hi, lo) updated with Grow (Collage-light)"),
    Strategy("plus", LOW_PRECISION, True, True, "weight_lo",
             "Collage-light plus the second moment as an MCF with beta2 split (Collage-plus)"),
    Strategy("split", (torch.bfloat16,), True, True, "weight_low_bits",
             "bf16 weight plus the 16 low bits of an fp32 master: exact fp32 update"),
    Strategy("plus8", (torch.bfloat16,), True, True, "weight_lo",
             "Collage-light weights; m in 1 byte (e4m3), v in 2 (e4m3 + 8 low bits), "
             "block-scaled, stochastically rounded (AdamW only)", eight_bit=True),
)

STRATEGIES: tuple[str, ...] = tuple(s.name for s in _ALL)
_BY_NAME = {s.name: s for s in _ALL}


def get_strategy(name: object) -> Strategy:
    """The :class:`Strategy` called ``name``; a ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ValueError(
            f"strategy {name!r} is unknown; valid strategies are: {', '.join(STRATEGIES)}"
        )
    return _BY_NAME[name]


def check_weight(strategy: Strategy, param: torch.Tensor, name: str) -> None:
    """Raise a TypeError naming the parameter, the strategy and the fix on a dtype mismatch."""
    if param.dtype in strategy.weight_dtypes:
        return
    accepted = " or ".join(str(d).replace("torch.", "") for d in strategy.weight_dtypes)
    have = str(param.dtype).replace("torch.", "")
    if param.dtype == torch.float32:
        fix = ("convert the model with model.to(torch.bfloat16), or use strategy='fp32' "
               "to keep float32 weights")
    elif strategy.name == "fp32":
        fix = ("use a low-precision strategy such as 'plus' or 'mixed' for "
               f"{have} weights, or convert the model with model.float()")
    else:
        fix = f"convert the parameter to {accepted}, or pick another strategy"
    raise TypeError(
        f"parameter {name!r} is {have} but strategy {strategy.name!r} needs {accepted} "
        f"weights: {fix}"
    )
