"""The plain data one step of one parameter group runs on, shared by every path.

The optimizer classes (and ``collage.optim.functional``) describe a group's step as a
:class:`GroupStep`: the rule and strategy, the hyperparameters, and per parameter an
:class:`Item` (its name, tensors, state dict, position in the optimizer and metric keys).
The paths (``eager``, ``compiled``, ``native``) see nothing else: never the optimizer.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..metrics import UpdateStats
from . import draws as keyed
from .rules import Rule
from .strategies import Strategy, check_weight
from .strategies.strategy import LOW_PRECISION

__all__ = ["Item", "make_item", "ITEM_PARAM", "ITEM_GRAD", "ITEM_STATE", "ITEM_POSITION",
           "PLAIN_TENSORS", "GroupStep", "Entry", "local", "entries_of", "check_item", "check_gradient",
           "advance_steps",
           "prepare_grad", "component_slice", "draw_key_at"]


#: the classes of plain tensors: no local shard to take, never sharded (a DTensor is of
#: its own class); a membership test of ``tensor.__class__`` is cheaper than ``hasattr``'s
#: miss in per-tensor loops
PLAIN_TENSORS = frozenset({torch.nn.Parameter, torch.Tensor})


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself. Runs per tensor and
    step: a plain tensor is recognised by its class (``hasattr``'s miss costs ten times
    more)."""
    if tensor.__class__ in PLAIN_TENSORS:
        return tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Item(NamedTuple):
    """One parameter of a group's step. ``param`` and ``grad`` may be DTensors; ``state``
    is the parameter's state dict (created by the strategy when empty); ``position``: its
    index over all the optimizer's parameters (a key of its stochastic draws);
    ``stat_keys``: the metric keys its measured sums are added to. A named tuple: one is
    made per parameter and step, and a tuple is the cheapest record to make."""

    name: str
    param: torch.Tensor
    grad: torch.Tensor
    state: dict
    position: int
    stat_keys: Sequence[str] = ("",)


#: ``make_item((name, param, grad, state, position, stat_keys))``: an :class:`Item` from
#: the tuple of all its fields, without the named tuple's Python-level ``__new__`` (a
#: Python frame per item: half of the time of gathering a step's items)
make_item = functools.partial(tuple.__new__, Item)

#: an :class:`Item`'s fields as getters that run in C (``map(ITEM_GRAD, items)``: passes
#: over a step's items without a Python frame per item), at their places in the tuple
ITEM_PARAM, ITEM_GRAD, ITEM_STATE, ITEM_POSITION = (
    operator.itemgetter(Item._fields.index(name))
    for name in ("param", "grad", "state", "position"))


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


@dataclass
class GroupStep:
    """Everything one step of one parameter group needs.

    ``hyper``: the group's hyperparameters (``rule.coefficients`` reads them);
    ``foreach``/``fused``/``reference``: the implementation flags (``dispatch.choose``);
    ``stats``: measure the step into it; ``cache``: a dict kept by the caller from step to
    step for this group (the native path keeps its call table there); ``warn``: called once
    with the reason when an asked-for acceleration is unavailable; ``found_nonfinite``: the
    non-finite check's verdict left on the device (a float32 scalar, nonzero: skip), for a
    path that reads it there (the Triton kernels) instead of the host deciding first."""

    rule: Rule
    strategy: Strategy
    hyper: Mapping
    items: list[Item]
    seed: int = 0
    grad_scale: torch.Tensor | None = None
    foreach: bool | None = None
    fused: bool | None = None
    reference: bool = False
    stats: UpdateStats | None = None
    cache: dict = field(default_factory=dict)
    warn: Callable[[str], None] = _warn
    found_nonfinite: torch.Tensor | None = None

    @property
    def maximize(self) -> bool:
        return bool(self.hyper.get("maximize", False))

    def coefficients(self, step: int) -> dict:
        return self.rule.coefficients(self.hyper, step)


class Entry:
    """An item with its local tensors: what a kernel call reads and writes."""

    __slots__ = ("item", "param", "grad", "tensors", "offset", "step", "native")

    def __init__(self, item: Item, param, grad, tensors: dict, offset: int | None) -> None:
        self.item = item
        self.param, self.grad = param, grad
        self.tensors = tensors  # the state's components (no "step"), local tensors
        self.offset = offset  # index of the first local element in the whole tensor
        self.step = 0
        self.native = None  # the native path's row tensors

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def state(self) -> dict:
        return self.item.state

    def contiguous_on(self, device: torch.device) -> bool:
        """Whether every tensor is contiguous on ``device`` (one flat range each)."""
        return all(t.is_contiguous() and t.device == device
                   for t in (self.param, self.grad, *self.tensors.values()))


def entries_of(group: GroupStep) -> list[Entry]:
    """Each item's local tensors, its state created first where it is empty. Every item is
    checked first (:func:`check_item`), so that a mismatch raises before anything changes."""
    for item in group.items:
        check_item(group, item)
    out = []
    for item in group.items:
        if not item.state:
            group.strategy.init_state(group.rule, item.param, item.state)
        tensors = {k: local(v) for k, v in item.state.items() if k != "step"}
        param = local(item.param)
        offset = keyed.flat_offset(item.param, param)
        out.append(Entry(item, param, local(item.grad), tensors, offset))
    return out


def check_gradient(name: str, param: torch.Tensor, grad: torch.Tensor) -> None:
    """A clear error where a gradient cannot step its parameter: sparse, of another dtype
    or shape."""
    if grad.is_sparse:
        raise RuntimeError(f"parameter {name!r} has a sparse gradient; collage optimizers "
                           "need dense gradients")
    if grad.layout is not torch.strided:
        raise RuntimeError(f"parameter {name!r} has a gradient of layout {grad.layout}; "
                           "collage optimizers need dense (torch.strided) gradients")
    if grad.dtype != param.dtype and not (grad.dtype == torch.float32
                                          and param.dtype in LOW_PRECISION
                                          and grad is not param.grad):
        # (a float32 gradient of a bf16 or fp16 weight that is not p.grad: the float32
        # sum of grad_accumulation="pair", accumulation.GradSums.gradients)
        raise TypeError(
            f"the gradient of parameter {name!r} is {grad.dtype} but the weight is "
            f"{param.dtype}; gradients must have the weight's dtype (do not cast .grad by "
            "hand; let autograd produce it)")
    if grad.shape != param.shape:
        raise ValueError(f"the gradient of parameter {name!r} has shape {tuple(grad.shape)} "
                         f"but the weight {tuple(param.shape)}")


def check_item(group: GroupStep, item: Item) -> None:
    """A clear error, naming the parameter and the fix, where its gradient or its state
    does not fit it: the parameter was converted or replaced after the optimizer made its
    state (``model.half()``, ``.to()``, ``p.data = ...``), or a state was loaded for another
    parameter. Reads no tensor data."""
    param, name = item.param, item.name
    check_gradient(name, param, item.grad)
    strategy = group.strategy
    if param.dtype not in strategy.weight_dtypes:
        check_weight(strategy, param, name)
    if item.state:
        mismatch = strategy.state_mismatch(group.rule, param, item.state)
        if mismatch is not None:
            raise ValueError(
                f"the optimizer state of parameter {name!r} does not fit it under strategy "
                f"{strategy.name!r}: {mismatch}. The parameter was converted or replaced "
                "after the optimizer made its state (model.half(), .to(), p.data = ...) or "
                "a state of another parameter was loaded: create the optimizer after "
                "converting the model, or load a state saved for this model")


def advance_steps(entries: Sequence[Entry]) -> None:
    """Add 1 to every entry's step counter, and read the new values (one sync)."""
    if not entries:
        return
    steps = [entry.state["step"] for entry in entries]
    torch._foreach_add_(steps, 1.0)
    values = torch.stack(steps).tolist() if len(steps) > 1 else [steps[0].item()]
    for entry, value in zip(entries, values):
        entry.step = int(value)


def draw_key_at(group: GroupStep, entry: Entry, first: int) -> torch.Tensor | None:
    """The draw key of ``entry``'s elements from local index ``first`` on, or None where the
    strategy draws nothing (``draws.draw_key``)."""
    if not group.strategy.draws:
        return None
    return keyed.draw_key(group.seed, entry.item.position, entry.step,
                          entry.offset + first, entry.param.device)


def prepare_grad(grad: torch.Tensor, grad_scale: torch.Tensor | None, maximize: bool
                 ) -> torch.Tensor:
    """The float32 gradient a fast kernel uses: unscaled for GradScaler, negated for
    ``maximize``."""
    grad = grad.float()
    if grad_scale is not None:
        grad = grad / grad_scale.to(grad.device)
    return -grad if maximize else grad


def component_slice(strategy: Strategy, rule: Rule, tensors: Mapping, start: int,
                    stop: int) -> dict:
    """Elements ``start:stop`` of each flat component: per-element tensors by element,
    per-block ones (plus8's scales) by block (``start`` on a block boundary)."""
    per = {c.key: c.per for c in strategy.components(rule)}
    out = {}
    for key, value in tensors.items():
        n = per.get(key, 1)
        out[key] = value.view(-1)[start // n:-(-stop // n)]
    return out
