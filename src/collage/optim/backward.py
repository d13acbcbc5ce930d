"""What the optimizers do during ``backward()``: the step in backward and the compensated
gradient accumulation (``docs/memory.md``).

Both run in a hook torch calls on each parameter once its gradient is complete
(``Tensor.register_post_accumulate_grad_hook``; who holds the hooks: ``hooks.py``):

* ``step_in_backward=True``: the hook hands the parameter to the backward's bucket
  (:func:`step_one`); a full bucket (:data:`BUCKETS`), and the bucket left at the
  end of the backward, are stepped as ``step()`` steps a group, one call per group of the
  bucket (:func:`flush`), and their gradients freed; ``opt.step()`` afterwards keeps the
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
from .nonfinite import finite_items_in_backward, report_skipped
from .step_hooks import never_traced
from .stepping import Batch, group_step, item_of, measuring
from .strategies import get_strategy

__all__ = ["GRAD_ACCUMULATIONS", "BUCKETS", "BUCKET_MAX_ELEMENTS", "Cycle", "check_keywords",
           "start_hooks", "on_grad_ready", "step_one", "flush", "take_cycle", "close_cycle",
           "free_gradients", "release_hooks", "write_grads"]

#: ``grad_accumulation``'s values: what happens to a gradient between backward and step
GRAD_ACCUMULATIONS = ("plain", "pair")

#: The step in backward steps the parameters whose gradients are complete in buckets, one
#: call per group of a bucket, instead of one call per parameter: a bucket is stepped once
#: it holds 1/BUCKETS of the optimizer's elements (so a backward takes about BUCKETS
#: calls per group), or BUCKET_MAX_ELEMENTS; what is left is stepped at the end of the
#: backward. Why these: a bucket holds its gradients until it is stepped, 1/16 of the
#: model's gradient bytes (0.125 B/param in bf16) against the 2 B/param the step in
#: backward saves; a call costs 50-150 us of Python, 16 of them a few percent of any step
#: long enough to matter; and 2**22 elements (8 MiB of bf16 gradients, 3-8 ms of step on
#: a CPU core) bound what a large model holds (docs/memory.md).
BUCKETS = 16
BUCKET_MAX_ELEMENTS = 1 << 22


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
    "wrote p.grad after autograd's accumulation. A backward under opt.paused() does (a GAN's "
    "generator loss through this model): zero the gradients it left (opt.zero_grad()) "
    "before the next step(). DDP does (the all-reduced gradient, at the end of backward), "
    "so the hook saw the local gradient only: this is not supported under DDP; leave "
    "step_in_backward and grad_accumulation at their defaults there")


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
    #: the parameters whose gradients are complete and not yet stepped (:func:`flush`),
    #: in the order their hooks ran, and their elements; a bucket is stepped at
    #: ``bucket_limit`` elements
    bucket: list[torch.Tensor] = field(default_factory=list)
    bucket_elements: int = 0
    bucket_limit: int = BUCKET_MAX_ELEMENTS

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
@never_traced
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
    elements = sum(param.numel() for group in optimizer.param_groups
                   for param in group["params"])
    optimizer._cycle = Cycle(owner, UpdateStats() if measuring(optimizer) else None,
                             bucket_limit=min(BUCKET_MAX_ELEMENTS, -(-elements // BUCKETS)))
    return optimizer._cycle


def step_one(optimizer, param: torch.Tensor) -> None:
    """A parameter's gradient is complete: into the backward's bucket, which is stepped
    when full and at the end of the backward (:func:`flush`). A gradient that arrives in
    parts (reentrant checkpointing) is left in ``p.grad`` for ``step()``."""
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
    cycle.this_backward.add(id(param))
    cycle.bucket.append(param)
    cycle.bucket_elements += param.numel()
    if cycle.bucket_elements >= cycle.bucket_limit:
        flush(optimizer, cycle)


def flush(optimizer, cycle: Cycle) -> None:
    """Step the bucket's parameters, each on the gradient its hook found complete, and
    free their gradients: what ``step()`` does to them, through the same dispatch, one
    call per group of the bucket (in the order the groups first appear in it). The
    non-finite policy is per parameter, as each gradient completed on its own."""
    params, cycle.bucket, cycle.bucket_elements = cycle.bucket, [], 0
    by_group: dict[int, tuple[dict, list]] = {}
    for param in params:
        index, group, name = cycle.owner[id(param)]
        by_group.setdefault(index, (group, []))[1].append(
            item_of(optimizer, index, group, name, param))
    for index, (group, items) in by_group.items():
        finite = finite_items_in_backward(optimizer, cycle, items)
        if finite:
            _step_items(optimizer, cycle, index, group, finite)
        for item in items:  # (a skipped one's too, as step() zeroes every gradient)
            item.param.grad = None


#: plans kept per group for the step in backward's buckets: their compositions repeat
#: from one backward to the next (the hooks run in the same order), so a few suffice; more
#: would only keep tables of buckets that no longer occur
_BUCKET_PLANS = 16


def _step_items(optimizer, cycle: Cycle, index: int, group: dict, items: list) -> None:
    book = optimizer._books[id(group)]
    # a plan (native, Triton) per bucket composition, kept in the group's cache (reset
    # with it) so that one bucket's plan never evicts another's
    plans = book.cache.setdefault("in_backward", {})
    key = tuple(id(item.param) for item in items)
    cache = plans.get(key)
    if cache is None:
        if len(plans) >= _BUCKET_PLANS:
            plans.pop(next(iter(plans)))
        cache = plans[key] = {}
    ready = dispatch.prepare(group_step(optimizer, index, group, items, cycle.stats, cache))
    strategy, writes = get_strategy(group["strategy"]), optimizer._writes
    params = [item.param for item in items]
    again = writes.rederive_edited(strategy, items, same_pointers=ready.plan_grads is not None)
    snapshot = writes.siblings_before(params)  # (views of one storage: edits.py)
    book.path = dispatch.run(ready)
    if hides_weight(strategy):
        if ready.by_plan and not again:
            writes.bumped(items)  # (dispatch moved their counters)
        else:
            writes.note(params)
    writes.siblings_after(snapshot, params)
    cycle.stepped.update(key)


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
    weight, as step() refuses it); at its end its bucket is stepped and what it stepped
    forgotten."""
    task = _graph_task()
    if task == cycle.task:
        return
    if cycle.task is not None:
        check_groups(optimizer)
    cycle.task = task

    def end_of_backward() -> None:
        flush(optimizer, cycle)
        cycle.this_backward.clear()

    torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)


def take_cycle(optimizer) -> Cycle | None:
    """At step(), first: the books of what the hooks did since the last step (None where
    no hook stepped); parameters unfrozen since hooked; GradScaler under the step in
    backward refused (it found no gradient to check), and under ``"pair"`` the low halves
    dropped where the scaler unscaled ``p.grad`` in place."""
    cycle, optimizer._cycle = optimizer._cycle, None
    if cycle is not None and cycle.bucket:  # a backward that raised before its end
        flush(optimizer, cycle)
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


def free_gradients(batches: list[Batch]) -> None:
    """After ``step()`` under the step in backward: the gradients it stepped (or skipped)
    freed, as :func:`flush` frees those of the hooks, so that every gradient is used once
    whether a hook or ``step()`` stepped it (``docs/memory.md``)."""
    for _, _, items in batches:
        for item in items:
            item.param.grad = None


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
