"""What a plan (``native/plan.py``, ``triton/plan.py``) checks per tensor at every step,
read in passes that run in C.

A plan reuses the last step's kernel arguments (data pointers) for the next steps; before
each, it must know that they still describe the group: the same parameters and state dicts,
every weight and state tensor where it was, every weight and gradient contiguous and of
the dtype and shape the table was built with. This runs per tensor and step, and on a GPU
the step's host time is what a 100M-parameter model waits for (issue #29; on a CPU, what
a small model's step is made of, #31). A Python loop over the tensors costs about 1 us per tensor on a
2-core Xeon; one pass in C (``map`` of a method or an attribute getter, lists compared
with ``==``: identity first, element by element in C) about 0.05 us. So each check
below is one such pass, and a step's checks cost about 0.5 us per tensor together.

Dtypes are singletons (compared by identity first); shapes are
``torch.Size`` tuples; a KeyError (a state key removed) fails the check.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter, is_, itemgetter

import torch

from .group import ITEM_GRAD, ITEM_PARAM, ITEM_STATE

__all__ = ["PlanTable"]

_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_DATA_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous


class PlanTable:
    """The tensors of a plan's items when it was built, and :meth:`gradients`, which
    checks the items of a later step against them."""

    __slots__ = ("params", "states", "getter", "many_keys", "param_pointers",
                 "state_pointers", "dtypes", "shapes")

    def __init__(self, items: Sequence, keys: Sequence[str]) -> None:
        """``items``: the group's items (``group.Item``) the plan was built from, each
        parameter's state holding a tensor at every one of ``keys``."""
        self.params = list(map(ITEM_PARAM, items))
        self.states = list(map(ITEM_STATE, items))
        # every key of a state dict in one call (a tuple of its tensors) where there are
        # several: one C call per state dict instead of one per key
        self.getter = itemgetter(*keys) if keys else None
        self.many_keys = len(keys) > 1
        self.param_pointers = list(map(_DATA_PTR, self.params))
        self.state_pointers = self._state_pointers(self.states)
        self.dtypes = list(map(_DTYPE, self.params))
        self.shapes = list(map(_SHAPE, self.params))

    def _state_pointers(self, states: list[dict]) -> list[int]:
        """The state tensors' data pointers, state by state and key by key in each (a
        KeyError where one is gone)."""
        if self.getter is None:  # no state tensors
            return []
        tensors = map(self.getter, states)
        return list(map(_DATA_PTR, chain.from_iterable(tensors) if self.many_keys
                        else tensors))

    def gradients(self, items: Sequence) -> list[torch.Tensor] | None:
        """The items' gradients if the items are the table's parameters in order, with
        the same state dicts, every weight and state tensor at the table's address, the
        weights and gradients contiguous and every weight and gradient of the table's dtype
        and shape; else None. Changes nothing. (The gradient's device is its parameter's:
        torch refuses any other, in ``.grad``'s setter and in autograd, and a parameter
        moved to another device has another address.)"""
        params = list(map(ITEM_PARAM, items))
        if len(params) != len(self.params):
            return None
        if not (all(map(is_, params, self.params))
                and all(map(is_, map(ITEM_STATE, items), self.states))):
            return None
        grads = list(map(ITEM_GRAD, items))
        # the weights' own dtype and shape too: ``p.data = p.data.view(torch.float16)`` (or
        # a narrower view) keeps the address and leaves the old gradient beside it, which
        # the general path refuses and the plan must not step as the old weight
        if (list(map(_DTYPE, grads)) != self.dtypes or list(map(_SHAPE, grads)) != self.shapes
                or list(map(_DTYPE, params)) != self.dtypes
                or list(map(_SHAPE, params)) != self.shapes
                or not all(map(_CONTIGUOUS, grads)) or not all(map(_CONTIGUOUS, params))):
            return None
        if list(map(_DATA_PTR, params)) != self.param_pointers:
            return None
        try:
            if self._state_pointers(self.states) != self.state_pointers:
                return None
        except KeyError:
            return None
        return grads
