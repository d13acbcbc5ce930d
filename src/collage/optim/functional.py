"""The functional core: one step of a rule under a strategy over lists of tensors, like
``torch.optim._functional``. The optimizer classes are thin over it (parameter groups,
validation, the non-finite policy, clipping, ``state_dict``).

Each parameter's state is a dict (created on the first step when empty) holding the
strategy's components and a float32 ``step`` counter, exactly what the classes keep in
``optimizer.state[p]``::

    states = [{} for _ in params]
    for batch in data:
        ...
        collage.optim.functional.adamw(params, [p.grad for p in params], states, lr=1e-3,
                                       strategy="plus")

Hyperparameters are checked as the classes check them; gradients must have the weight's
dtype (or float32) and shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..metrics import UpdateStats
from . import dispatch
from .group import GroupStep, Item
from .rules import ADAMW, LION, SGD, Rule
from .strategies import DEFAULT_STRATEGY, get_strategy

__all__ = ["adamw", "sgd", "lion", "step"]


def step(rule: Rule, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
         states: Sequence[dict], hyper: dict, *, strategy: str = DEFAULT_STRATEGY,
         foreach: bool | None = None, fused: bool | None = None, reference: bool = False,
         grad_scale: torch.Tensor | None = None, seed: int = 0,
         positions: Sequence[int] | None = None, names: Sequence[str] | None = None,
         stats: UpdateStats | None = None, cache: dict | None = None,
         warn: Callable[[str], None] | None = None) -> str | None:
    """One step of ``rule`` with hyperparameters ``hyper`` (``rule.coefficients`` reads
    them) over ``params``; returns the path that ran (``dispatch.PATHS``).

    ``positions``: each parameter's key for stochastic draws (default 0, 1, ...);
    ``names``: for metric keys and messages; ``stats``: measure the step (keys ``""`` and
    each name); ``cache``: a dict kept between calls for the same parameters (the native
    path's call table); ``warn``: receives the reason a requested acceleration fell back.
    """
    if not len(params) == len(grads) == len(states):
        raise ValueError(f"params, grads and states must have the same length, got "
                         f"{len(params)}, {len(grads)} and {len(states)}")
    resolved = get_strategy(strategy)
    resolved.check_rule(rule)
    hyper = dict(hyper, reference=reference)
    rule.validate(hyper)
    resolved.check_group(rule, hyper)
    names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
    positions = list(positions) if positions is not None else list(range(len(params)))
    items = [Item(name, p, g, s, pos, ("", name) if stats is not None else ("",))
             for name, p, g, s, pos in zip(names, params, grads, states, positions)]
    group = GroupStep(rule, resolved, hyper, items, seed=seed, grad_scale=grad_scale,
                      foreach=foreach, fused=fused, reference=reference, stats=stats,
                      cache={} if cache is None else cache)
    if warn is not None:
        group.warn = warn
    with torch.no_grad():
        return dispatch.step_group(group)


def adamw(params, grads, states, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, weight_decay_style: str = "compact",
          maximize: bool = False, **options) -> str | None:
    """AdamW (``torch.optim.AdamW``'s arithmetic; the research code's on the reference
    path) under a strategy; ``options`` as :func:`step`."""
    hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                 weight_decay_style=weight_decay_style, maximize=maximize)
    return step(ADAMW, params, grads, states, hyper, **options)


def sgd(params, grads, states, *, lr: float = 1e-3, momentum: float = 0.0,
        dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
        maximize: bool = False, **options) -> str | None:
    """SGD (``torch.optim.SGD``'s arithmetic) under a strategy; ``options`` as :func:`step`."""
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                 nesterov=nesterov, maximize=maximize)
    return step(SGD, params, grads, states, hyper, **options)


def lion(params, grads, states, *, lr: float = 1e-4, betas=(0.9, 0.99),
         weight_decay: float = 0.0, maximize: bool = False, **options) -> str | None:
    """Lion under a strategy; ``options`` as :func:`step`."""
    hyper = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
    return step(LION, params, grads, states, hyper, **options)
