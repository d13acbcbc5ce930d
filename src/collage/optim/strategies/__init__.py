"""Precision strategies: how weights and optimizer states are stored, and how updates land.

An update rule (AdamW, SGD, Lion) computes the *intended* update; the strategy decides the
storage of the weight, of what is kept beside it and of the rule's states, and the
arithmetic that lands the update. Each strategy is one module of this package defining a
:class:`Strategy` subclass and its instance ``STRATEGY``; this registry finds them, so that
adding a strategy is adding its module (``docs/design.md``). The names are public API.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import SimpleNamespace

import torch

from .strategy import Component, Strategy

__all__ = ["STRATEGIES", "NAMES", "MAIN_STRATEGIES", "DEFAULT_STRATEGY", "Component",
           "Strategy", "get_strategy", "all_strategies", "check_weight"]


def _discover() -> dict[str, Strategy]:
    """Every module of this package that defines ``STRATEGY``, by ``order``."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        if module.name == "strategy":
            continue
        strategy = getattr(importlib.import_module(f"{__name__}.{module.name}"), "STRATEGY",
                           None)
        if isinstance(strategy, Strategy):
            found.append(strategy)
    found.sort(key=lambda s: (s.order, s.name))
    return {s.name: s for s in found}


_BY_NAME = _discover()
STRATEGIES: tuple[str, ...] = tuple(_BY_NAME)
#: the registered names as attributes (``NAMES.plus == "plus"``): code outside this package
#: names a strategy through it, never as a string literal (tests/test_layout.py), so that a
#: misspelt or unregistered name fails at import
NAMES = SimpleNamespace(**{name: name for name in STRATEGIES})
#: the main report's strategies, in ``STRATEGIES`` order: what comparisons and benchmarks
#: run when none are named (every strategy but the ``opt_in`` ones)
MAIN_STRATEGIES: tuple[str, ...] = tuple(name for name, s in _BY_NAME.items() if not s.opt_in)
#: the strategy the optimizers use when none is named
DEFAULT_STRATEGY: str = NAMES.plus


def all_strategies() -> tuple[Strategy, ...]:
    """Every strategy, in ``STRATEGIES`` order."""
    return tuple(_BY_NAME.values())


def get_strategy(name: object) -> Strategy:
    """The :class:`Strategy` called ``name`` (a Strategy is returned as is); a ValueError
    listing the valid names otherwise."""
    if isinstance(name, Strategy):
        return name
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ValueError(
            f"strategy {name!r} is unknown; valid strategies are: {', '.join(STRATEGIES)}"
        )
    return _BY_NAME[name]


def check_weight(strategy: Strategy, param: torch.Tensor, name: str,
                 asked: str | None = None) -> None:
    """Raise a TypeError naming the parameter, the strategy and the fix on a dtype mismatch.
    ``asked``: the strategy the user named, where ``strategy`` is one of its rungs
    (``"auto"``)."""
    if param.dtype in strategy.weight_dtypes:
        return
    accepted = " or ".join(str(d).replace("torch.", "") for d in strategy.weight_dtypes)
    have = str(param.dtype).replace("torch.", "")
    if param.dtype == torch.float32:
        fix = ("convert the model with model.to(torch.bfloat16), or use strategy='fp32' "
               "to keep float32 weights")
    elif torch.float32 in strategy.weight_dtypes:
        fix = ("use a low-precision strategy such as 'plus' or 'mixed' for "
               f"{have} weights, or convert the model with model.float()")
    else:
        fix = f"convert the parameter to {accepted}, or pick another strategy"
    named = (repr(strategy.name) if asked is None
             else f"{asked!r} (at its rung {strategy.name!r})")
    raise TypeError(f"parameter {name!r} is {have} but strategy {named} needs {accepted} "
                    f"weights: {fix}")
