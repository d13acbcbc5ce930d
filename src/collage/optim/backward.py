"""What the optimizers do during ``backward()``: the step in backward and the compensated
gradient accumulation (``docs/memory.md``).

Both run in a hook torch calls on each parameter once its gradient is complete
(``Tensor.register_post_accumulate_grad_hook``; who holds the hooks: ``hooks.py``):

* ``step_in_backward=True``: the hook steps the parameter (:func:`step_one`: what ``step()``
  does to it, as a group of one) and frees ``p.grad``; ``opt.step()`` afterwards keeps the
  books (:class:`Cycle`: :func:`take_cycle`, :func:`close_cycle`) and steps what a
  reentrant checkpoint left to it.
* ``grad_accumulation="pair"``: the hooks keep a float32 running sum, its nearest bf16 in
  ``p.grad`` and its low half in the optimizer (``accumulation.py``); ``step()`` reads the
  float32 sum itself.

The plain parts (the keywords' validation, the hooks' bookkeeping), then the functions of
the optimizer that wire them: it keeps ``_cycle``, ``_sums`` and ``_hooks``
(:func:`start_hooks`), and parameters are hooked as they join (``admission.py``:
``HookSet.admit``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..metrics import UpdateStats
from . import dispatch
from .accumulation import GradSums, PairHooks
from .admission import check_groups, convert_strategies, param_names
from .edits import hides_weight
from .hooks import HookSet, inside_reentrant_backward, refuse_data_parallel
from .nonfinite import finite_in_backward, report_skipped
from .stepping import Batch, group_step, item_of, measuring
from .strategies import get_strategy

__all__ = ["GRAD_ACCUMULATIONS", "Cycle", "check_keywords", "start_hooks", "on_grad_ready",
           "step_one", "take_cycle", "close_cycle", "release_hooks", "write_grads"]

#: ``grad_accumulation``'s values: what happens to a gradient between backward and step
GRAD_ACCUMULATIONS = ("plain", "pair")


def check_keywords(step_in_backward: object, grad_accumulation: object) -> None:
    """Clear errors for the two keywords and their one forbidden combination."""
    if not isinstance(step_in_backward, bool):
        raise TypeError(f"step_in_backward must be True or False, got {step_in_backward!r}")
    if grad_accumulation not in GRAD_ACCUMULATIONS:
        raise ValueError(f"grad_accumulation={grad_accumulation!r} is unknown; use one of: "
                         f"{', '.join(map(repr, GRAD_ACCUMULATIONS))}")
    if step_in_backward and grad_accumulation != "plain":
        raise ValueError(
            "step_in_backward=True steps each parameter during every backward(), so there "
            "is no gradient left to accumulate: grad_accumulation='pair' needs "
            "step_in_backward=False (accumulate over micro-batches, then step())")


_WRITTEN_AFTER = (
    "parameter {name!r} has a gradient written after backward's hook ran: {what}. Something "
    "wrote p.grad after autograd's accumulation; DDP does (the all-reduced gradient, at the "
    "end of backward), so the hook saw the local gradient only. This is not supported under "
    "DDP: leave step_in_backward and grad_accumulation at their defaults there")


@dataclass
class Cycle:
    """What the hooks of one backward pass (or several, until ``step()``) share: checked
    once at its first hook. ``owner``: ``id(param)``: (group index, group, name);
    ``stats``: the measured sums of this step, or None; ``skipped``: names of parameters
    whose non-finite gradient was skipped (``nonfinite="skip"``); ``stepped``: the
    parameters a hook stepped."""

    owner: dict[int, tuple[int, dict, str]]
    stats: UpdateStats | None
    skipped: list[str] = field(default_factory=list)
    #: ``id(param)`` of the parameters stepped by a hook
    stepped: set[int] = field(default_factory=set)
    #: ``id(param)`` of those stepped by a hook in the backward running now (emptied at
    #: its end: :func:`_note_backward`)
    this_backward: set[int] = field(default_factory=set)
    #: ``id(param)`` of the parameters left to ``step()``: their gradient arrived in parts,
    #: in the nested backward of a reentrant checkpoint (:func:`_defer`)
    deferred: set[int] = field(default_factory=set)
    #: the autograd graph task of the last ordinary (not nested) hook: a new one is a new
    #: backward, whose hyperparameters are checked again
    task: int | None = None
    #: graph task id: whether it is a reentrant checkpoint's nested backward
    nested: dict[int, bool] = field(default_factory=dict)

    def refuse_regrown(self, names_and_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A parameter stepped in backward that has a gradient again at step(): something
        wrote ``p.grad`` after autograd's accumulation. DDP does (the all-reduced gradient,
        at the end of backward): the step used the local gradient. Refuse, saying so."""
        for name, param in names_and_params:
            if id(param) in self.stepped:
                raise RuntimeError(_WRITTEN_AFTER.format(
                    name=name, what="step_in_backward=True stepped it on the gradient "
                    "autograd completed, and freed it"))


# ----------------------------------------------------------------------- the optimizer's

_SCALER_IN_BACKWARD = (
    "GradScaler cannot be used with step_in_backward=True: the parameters are stepped "
    "during backward, on the scaled gradients, before the scaler unscales or checks them "
    "(the weights stepped in the last backward used scaled gradients). Use bf16 weights "
    "without a scaler, or step_in_backward=False")


def start_hooks(optimizer) -> None:
    """The hooks of ``step_in_backward`` and ``grad_accumulation="pair"``; parameters are
    hooked as they join (``admission.py``)."""
    optimizer._cycle = None
    optimizer._sums = GradSums()
    wanted = optimizer.step_in_backward or optimizer.grad_accumulation != "plain"
    optimizer._hooks = (None if not wanted
                        else PairHooks(optimizer, _hooked_feature(optimizer))
                        if optimizer.grad_accumulation == "pair"  # (accumulation.py)
                        else HookSet(optimizer, on_grad_ready, _hooked_feature(optimizer)))


def _hooked_feature(optimizer) -> str:
    return ("step_in_backward=True" if optimizer.step_in_backward
            else f"grad_accumulation={optimizer.grad_accumulation!r}")


# Autograd calls it in the middle of backward: never traced (see CollageOptimizer.step).
@torch.compiler.disable
@torch.no_grad()
def on_grad_ready(optimizer, param: torch.Tensor) -> None:
    """A parameter's gradient is complete (its post-accumulate-grad hook)."""
    refuse_data_parallel((), _hooked_feature(optimizer))  # a process group made since
    if optimizer.step_in_backward:
        step_one(optimizer, param)


def _open_cycle(optimizer) -> Cycle:
    """At the first hook since the last step: check the groups as step() does, once,
    and decide whether this step is measured."""
    check_groups(optimizer)
    convert_strategies(optimizer)
    owner = {id(param): (index, group, name)
             for index, group in enumerate(optimizer.param_groups)
             for name, param in zip(param_names(group, index), group["params"])}
    optimizer._cycle = Cycle(owner, UpdateStats() if measuring(optimizer) else None)
    return optimizer._cycle


def step_one(optimizer, param: torch.Tensor) -> None:
    """Step one parameter on its complete gradient, then free the gradient: what
    step() does to it, through the same dispatch, as a group of one. A gradient that
    arrives in parts (reentrant checkpointing) is left in ``p.grad`` for ``step()``."""
    cycle = optimizer._cycle if optimizer._cycle is not None else _open_cycle(optimizer)
    owner = cycle.owner.get(id(param))
    if owner is None or param.grad is None:  # not ours (a hook copied with the model)
        return
    if _in_parts(cycle) or id(param) in cycle.deferred:
        _defer(cycle, param, owner[2])
        return
    _note_backward(optimizer, cycle)
    if getattr(optimizer, "grad_scale", None) is not None:
        raise RuntimeError(_SCALER_IN_BACKWARD)
    index, group, name = owner
    item = item_of(optimizer, index, group, name, param)
    if finite_in_backward(optimizer, cycle, item):
        book = optimizer._books[id(group)]
        # a plan (native, Triton) per parameter, kept in the group's cache (reset with
        # it) so that the parameters' plans never evict each other
        cache = book.cache.setdefault(("in_backward", id(param)), {})
        ready = dispatch.prepare(group_step(optimizer, index, group, [item], cycle.stats,
                                            cache))
        strategy = get_strategy(group["strategy"])
        again = optimizer._writes.rederive_edited(
            strategy, [item], same_pointers=ready.plan_grads is not None)
        book.path = dispatch.run(ready)
        if hides_weight(strategy):
            if ready.by_plan and not again:
                optimizer._writes.bumped([item])  # (dispatch moved its counter)
            else:
                optimizer._writes.note((param,))
        cycle.stepped.add(id(param))
        cycle.this_backward.add(id(param))
    param.grad = None


def _in_parts(cycle: Cycle) -> bool:
    """Whether the hook runs in a reentrant checkpoint's nested backward
    (:func:`hooks.inside_reentrant_backward`), found once per autograd graph task."""
    task = _graph_task()
    nested = cycle.nested.get(task)
    if nested is None:
        nested = cycle.nested[task] = inside_reentrant_backward()
    return nested


def _graph_task() -> int:
    return torch._C._current_graph_task_id()


def _defer(cycle: Cycle, param: torch.Tensor, name: str) -> None:
    """Leave ``param``'s gradient to ``step()``: a reentrant checkpoint segment gave part
    of it, and the enclosing backward or another segment may add more (torch runs the hook
    at the end of each nested backward). ``step()`` steps it once, on the whole gradient,
    as without ``step_in_backward``. A parameter a hook stepped earlier in this same
    backward cannot be mended: refuse, naming it and the fix."""
    key = id(param)
    if key in cycle.this_backward:
        raise RuntimeError(
            f"parameter {name!r} was stepped in this backward (step_in_backward=True) and "
            "then received more gradient from a reentrant activation checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True): its step used part of its "
            "gradient. Use use_reentrant=False (torch's recommended default), or "
            "step_in_backward=False")
    cycle.deferred.add(key)
    cycle.stepped.discard(key)  # its gradient at step() is the deferred one, not a rewrite


def _note_backward(optimizer, cycle: Cycle) -> None:
    """At a hook of an ordinary backward: a backward not seen yet has its groups checked
    again (a hyperparameter changed between two backwards is refused before it moves a
    weight, as step() refuses it), and what it steps is forgotten at its end."""
    task = _graph_task()
    if task == cycle.task:
        return
    if cycle.task is not None:
        check_groups(optimizer)
    cycle.task = task
    this_backward = cycle.this_backward
    torch.autograd.Variable._execution_engine.queue_callback(this_backward.clear)


def take_cycle(optimizer) -> Cycle | None:
    """At step(), first: the books of what the hooks did since the last step (None where
    no hook stepped); parameters unfrozen since hooked; GradScaler under the step in
    backward refused (it found no gradient to check), and under ``"pair"`` the low halves
    dropped where the scaler unscaled ``p.grad`` in place."""
    cycle, optimizer._cycle = optimizer._cycle, None
    if optimizer._hooks is not None:
        optimizer._hooks.refresh()  # parameters unfrozen since: hooked for the next backward
    _refuse_scaler_after_hooks(optimizer)
    return cycle


def close_cycle(optimizer, cycle: Cycle, batches: list[Batch]) -> None:
    """At step(), once the step's gradients are gathered: refuse a gradient written after
    its hook stepped the parameter, and count the parameters the hooks skipped."""
    cycle.refuse_regrown((item.name, item.param) for _, _, items in batches
                         for item in items)
    report_skipped(optimizer, cycle)


def _refuse_scaler_after_hooks(optimizer) -> None:
    """GradScaler sets ``found_inf`` from the gradients it sees in p.grad: under our
    hooks there are none (stepped, or accumulated here)."""
    if getattr(optimizer, "found_inf", None) is None:
        return
    if optimizer.step_in_backward:
        raise RuntimeError(_SCALER_IN_BACKWARD)
    if getattr(optimizer, "grad_scale", None) is None:
        # grad_accumulation="pair": scaler.unscale_ divided p.grad (the sums' high halves)
        # in place, not the low halves: p.grad alone is the gradient (accumulation.py)
        optimizer._sums.drop_lows()


def release_hooks(optimizer) -> None:
    """``optimizer.release_hooks()``: the hooks removed, and the optimizer plain from now
    on (``step_in_backward=False``, ``"plain"``). A ``"pair"`` sum held so far stays: the
    next step reads it while ``p.grad`` is as the hooks left it; a later backward adds into
    ``p.grad`` in bf16, as plain accumulation does, and the low half is dropped."""
    if optimizer._hooks is None:
        return
    write_grads(optimizer)
    optimizer._hooks.remove()
    optimizer._hooks = None
    optimizer.step_in_backward = False
    optimizer.grad_accumulation = "plain"


def write_grads(optimizer) -> None:
    """``optimizer.write_grads()``: nothing left to write (``grad_accumulation="pair"``
    keeps each sum's high half in ``p.grad``); the held low halves checked against
    ``p.grad`` (:meth:`accumulation.GradSums.settle`)."""
    optimizer._sums.settle()
