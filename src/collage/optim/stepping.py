"""The phases of one step of the optimizer (``CollageOptimizer.step`` calls them in order).

Between the checks (``admission.py``) and the non-finite policy (``nonfinite.py``):

* :func:`gather`: per group, the parameters with gradients as items (``group.Item``);
* :func:`group_steps`: the plain data of each group's step (``group.GroupStep``);
* :func:`step_planned`: every group on its native plan: one C call checks and steps them all
  (a small model's step is mostly fixed costs, #31);
* :func:`prepare`: otherwise every group checked and its path chosen before any is stepped;
* :func:`land`: the weights written since the last step re-derived (``edits.py``), each
  group run by its path (``dispatch.run``: where the updates land), what the step left in
  the weights recorded, the step counted and its measured sums kept.

Functions of the optimizer: they read its groups' books (``_books``), positions, state and
edit log (``_writes``), and count its steps (``_steps_taken``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator

import torch

from ..metrics import UpdateStats
from . import dispatch
from .admission import param_names, states_of
from .autopilot import AUTO, cache_of, owner_of
from .edits import hides_weight
from .group import ITEM_GRAD, ITEM_PARAM, GroupStep, Item, check_gradient, make_item
from .nonfinite import report_nonfinite, shard_group
from .strategies import get_strategy

__all__ = ["Batch", "gather", "item_of", "sharded_over", "stats_for", "measuring",
           "group_steps", "group_step", "step_planned", "prepare", "land",
           "rederive_pending"]

#: (group index, group, items): one group's share of a step
Batch = tuple[int, dict, list[Item]]

_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")


def gather(optimizer) -> list[Batch]:
    """(group index, group, items) for the parameters that have gradients. This runs
    every step, per parameter (issue #29: on a GPU it is host time the step waits
    for): each group is read in passes that run in C (``map`` over the parameters: a
    Python loop costs about 1 us per parameter, a pass about 0.05 us), each item made
    as the tuple it is, without the named tuple's Python-level constructor. Only the
    layout is checked here (a sparse gradient is refused before the non-finite check
    reads it); each path checks dtype and shape where it takes its items
    (``group.check_item``, or a plan against its table), before anything changes."""
    positions = optimizer._positions
    state = optimizer.state
    sums = optimizer._sums
    batches = []
    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        names = param_names(group, index)
        grads = list(map(_GRAD, params))
        if sums:  # grad_accumulation="pair": the float32 sums, not their high halves
            grads = sums.gradients(params, grads)
        if any(map(operator.is_, grads, itertools.repeat(None))):
            present = [grad is not None for grad in grads]
            params = list(itertools.compress(params, present))
            names = list(itertools.compress(names, present))
            grads = list(itertools.compress(grads, present))
        if list(map(_LAYOUT, grads)).count(torch.strided) != len(grads):
            # a sparse gradient: refused here, before the non-finite check reads it;
            # dtype and shape are checked where each path takes its items (a plan
            # compares them with its table, the other paths check every item)
            for name, param, grad in zip(names, params, grads):
                check_gradient(name, param, grad)
        group_keys = ("", f"group{index}")
        # per tensor where named, and always under "auto" (the autopilot reads them)
        keys = ([(*group_keys, name) for name in names]
                if "param_names" in group or group["strategy"] == AUTO
                else itertools.repeat(group_keys))
        items = list(map(make_item, zip(
            names, params, grads, map(state.__getitem__, params),
            map(positions.__getitem__, map(id, params)), keys)))
        batches.append((index, group, items))
    # "auto" groups: one batch per rung, each stepped as its strategy (autopilot.py)
    return optimizer._pilot.split(batches)


def item_of(optimizer, index: int, group: dict, name: str, param: torch.Tensor) -> Item:
    """One parameter's item, as :func:`gather` makes it (the same metric keys)."""
    check_gradient(name, param, param.grad)
    keys = ("", f"group{index}")
    if "param_names" in group or group["strategy"] == AUTO:
        keys = (*keys, name)
    return Item(name, param, param.grad, optimizer.state[param],
                optimizer._positions[id(param)], keys)


def sharded_over(batches: list[Batch]):
    """The process group the step's parameters are sharded over (FSDP2), or None
    (``nonfinite.shard_group``)."""
    return shard_group(itertools.chain.from_iterable(map(ITEM_PARAM, items)
                                                     for _, _, items in batches))


def measuring(optimizer) -> bool:
    """Whether this step measures lost updates (``track_updates``: every k-th step; the
    autopilot's steps, ``autopilot.Pilot.due``)."""
    steps = optimizer._steps_taken
    return (optimizer.track_updates > 0 and steps % optimizer.track_updates == 0
            ) or optimizer._pilot.due(steps)


def stats_for(optimizer, cycle) -> UpdateStats | None:
    """The sums this step measures into: those the hooks of its backward opened
    (``cycle``: the step in backward's), else new ones when the step is measured."""
    if cycle is not None:
        return cycle.stats
    return UpdateStats() if measuring(optimizer) else None


def group_steps(optimizer, batches: list[Batch], stats: UpdateStats | None
                ) -> list[GroupStep]:
    return [group_step(optimizer, index, group, items, stats)
            for index, group, items in batches]


def group_step(optimizer, index: int, group: dict, items: list[Item],
               stats: UpdateStats | None, cache: dict | None = None) -> GroupStep:
    """The plain data of one group's step (``group.GroupStep``); ``cache``: the paths'
    cache, the group's by default (a rung of an "auto" group: the rung's)."""
    book = optimizer._books[id(owner_of(group))]
    return GroupStep(
        optimizer.rule, get_strategy(group["strategy"]), book.values, items,
        seed=optimizer.seed, grad_scale=getattr(optimizer, "grad_scale", None),
        foreach=group["foreach"], fused=group["fused"], reference=group["reference"],
        stats=stats, cache=cache_of(book, group) if cache is None else cache,
        warn=optimizer._warn_fallback)


def step_planned(optimizer, batches: list[Batch], planned: list) -> bool:
    """Every group on its native plan (``planned``, from ``prepare_native_plans``), and
    nothing else due this step: no GradScaler verdict, no weight written since our last
    step (nothing to re-derive). Then one C call checks every gradient for inf and nan
    and steps every group (``dispatch.step_native_plans``: a small model's step is
    mostly fixed costs, #31), with the general way's semantics: a non-finite gradient
    anywhere skips the step (or raises) with every weight and state unchanged. True: the
    step was made, skipped or refused; False: nothing was written (nor the finite proof
    of ``clip_grad_norm_`` used), the caller takes the general way."""
    if getattr(optimizer, "found_inf", None) is not None or not all(
            optimizer._writes.nothing_to_rederive(ready.group.strategy, ready.group.items)
            for ready in planned if ready is not None):
        return False
    proof = optimizer._finite_proof
    check = optimizer.nonfinite != "ignore" and not (
        proof is not None and proof.spares_check_of(list(itertools.chain.from_iterable(
            map(ITEM_GRAD, items) for _, _, items in batches))))
    writes = optimizer._writes
    snapshot = writes.siblings_before(_params(batches))  # (views of one storage: edits.py)
    stepped = dispatch.step_native_plans(planned, check)
    if stepped is None:  # a step counter was changed since: the general way reads them
        return False
    # as nonfinite.gradients_usable leaves them
    optimizer._finite_proof = optimizer._unchecked = None
    if not stepped:
        report_nonfinite(optimizer, batches)  # raises, or counts the skipped step
        return True
    books = optimizer._books
    for (_, group, _), ready in zip(batches, planned):
        if ready is not None:
            books[id(owner_of(group))].path = ready.path
            if hides_weight(ready.group.strategy):
                writes.bumped(ready.group.items)  # (dispatch moved their counters)
    writes.siblings_after(snapshot, _params(batches))
    optimizer._steps_taken += 1
    return True


def _params(batches: list[Batch]) -> Iterator[torch.Tensor]:
    """Every parameter of the step, lazily: read only where some share a storage."""
    return (item.param for _, _, items in batches for item in items)


def prepare(batches: list[Batch], steps: list[GroupStep], planned: list | None) -> list:
    """(group, its ``dispatch.Prepared`` or None) for every group: every group is checked
    before any is stepped, so a mismatch changes nothing (``planned``: the native plans
    :func:`step_planned` did not take, already prepared)."""
    return [(group, dispatch.prepare(step) if planned is None else ready)
            for (_, group, _), step, ready
            in zip(batches, steps, planned or itertools.repeat(None))]


def land(optimizer, batches: list[Batch], prepared: list, stats: UpdateStats | None,
         sharded) -> None:
    """Step every prepared group: after every check (a refused step changes nothing),
    before any kernel, the weights written since our last step become the ones the step
    starts from (``edits.py``); then each group's path runs (``dispatch.run``), what the
    step left in the weights is recorded, and the step counted with its measured sums."""
    rederived = _rederive_edits(optimizer, batches, prepared)
    snapshot = optimizer._writes.siblings_before(_params(batches))  # (views: edits.py)
    books = optimizer._books
    for group, ready in prepared:
        if ready is not None:
            books[id(owner_of(group))].path = dispatch.run(ready)
    _note_writes(optimizer, batches, prepared, rederived)
    optimizer._writes.siblings_after(snapshot, _params(batches))
    step = optimizer._steps_taken
    optimizer._steps_taken += 1
    if stats is not None:
        if sharded is not None:
            stats.reduce_(sharded)
        optimizer.update_stats = stats.to_dict()
        if optimizer._pilot.due(step):  # promotions (autopilot.py), after the writes noted
            optimizer.update_stats.update(optimizer._pilot.decide(
                optimizer, batches, optimizer.update_stats, step))


def _rederive_edits(optimizer, batches: list[Batch], prepared: list) -> list[bool]:
    """Per group: whether a weight written since our last step had its hidden
    components set from it (``edits.WriteLog.rederive_edited``). A group about to
    run its plan has had every weight's pointer checked against the plan's table."""
    writes = optimizer._writes
    return [writes.rederive_edited(
        get_strategy(group["strategy"]), items,
        same_pointers=ready is not None and ready.plan_grads is not None)
        for (_, group, items), (_, ready) in zip(batches, prepared)]


def _note_writes(optimizer, batches: list[Batch], prepared: list, rederived: list[bool]
                 ) -> None:
    """Record what this step left in the weights it wrote (``edits.WriteLog``). A group
    stepped by its plan, nothing re-derived, left them as the check read them but for
    the version counters dispatch moved by one: the records move with them."""
    for (_, group, items), (_, ready), again in zip(batches, prepared, rederived):
        if not hides_weight(get_strategy(group["strategy"])):
            continue
        if ready is not None and ready.by_plan and not again:
            optimizer._writes.bumped(items)
        else:
            optimizer._writes.note(item.param for item in items)


def rederive_pending(optimizer) -> None:
    """Apply now the re-derivations the next step would make (``edits.py``), so that
    what is saved or exported beside the weights describes them."""
    pilot, positions = optimizer._pilot, optimizer._positions
    for index, group in enumerate(optimizer.param_groups):
        by_strategy: dict[str, list] = {}
        for _, p, s in states_of(optimizer, group, index):
            by_strategy.setdefault(pilot.strategy_at(group["strategy"], positions[id(p)]),
                                   []).append((p, s))
        for name, pairs in by_strategy.items():
            optimizer._writes.rederive_pending(get_strategy(name), pairs)
