"""The native path: a group's step as one C call per (step value, gradient dtype)."""

from __future__ import annotations

from array import array

import torch

from ..draws import stochastic_key
from ..group import Entry, GroupStep, advance_steps
from . import calls
from . import plan as plans
from .plan import NativePlan

__all__ = ["planned", "step_plans", "step_planned", "native_entries", "step_native"]

_PLAN = "native_plan"


def planned(group: GroupStep) -> array | None:
    """The gradient pointers for the plan the group's last native step left in
    ``group.cache``, if it still describes the group (``NativePlan.ready``); else None,
    the plan dropped. Changes nothing else."""
    plan = group.cache.get(_PLAN)
    grads = None if plan is None or group.stats is not None else plan.ready(group)
    if grads is None:
        group.cache.pop(_PLAN, None)
    return grads


def step_plans(runs: list[tuple[GroupStep, array]], check: bool) -> bool | None:
    """Step every ``(group, planned(group)'s pointers)`` by its plan in one C call
    (``plan.step_plans``); with ``check``, not before reading every gradient for inf and
    nan. True: stepped; False: a gradient is not finite; None: a step counter was changed
    since its plan's step (then :func:`step_planned`, group by group, steps the groups
    whose counters hold and drops the other plans). Nothing written on False and None."""
    return plans.step_plans([(group.cache[_PLAN], group, grads) for group, grads in runs],
                            check)


def step_planned(group: GroupStep, grads: array) -> bool:
    """Step with the plan and :func:`planned`'s pointers; False (nothing changed, the plan
    dropped) where a step counter changed since."""
    if group.cache[_PLAN].step(group, grads):
        return True
    group.cache.pop(_PLAN)
    return False


def native_entries(group: GroupStep, entries: list[Entry]) -> list[Entry]:
    """The entries the kernels can take (their row tensors attached): contiguous CPU
    tensors of the kernel's dtypes, one flat range each where the strategy draws (the
    draws are keyed by the element's index in the whole tensor); the rest are left to the
    caller. A shard on an inner dimension (FSDP2's ``Shard(1)``) is contiguous locally:
    without draws every element's step is its own, so the kernels take it too, and it
    gets their bits (their square root is IEEE's, torch's CPU one not always)."""
    device = torch.device("cpu")
    out = []
    for entry in entries:
        if ((entry.offset is None and group.strategy.draws)
                or not entry.contiguous_on(device)):
            continue
        entry.native = calls.row_tensors(group.rule, group.strategy, entry.param, entry.grad,
                                         entry.tensors, checked=True)
        if entry.native is not None:
            out.append(entry)
    return out


def step_native(group: GroupStep, entries: list[Entry], whole_group: bool) -> None:
    """Step ``entries`` (from :func:`native_entries`): one call per (step value, gradient
    dtype) over all of them; measured into ``group.stats`` when set. ``whole_group``: the
    entries are every item of the group, so the call can be planned for the next step."""
    advance_steps(entries)
    jobs: dict[tuple, list[int]] = {}
    for position, entry in enumerate(entries):
        if entry.numel:
            jobs.setdefault((entry.step, entry.grad.dtype), []).append(position)
    sums = None
    if group.stats is not None:  # one row per entry; an empty tensor adds zeros
        sums = torch.zeros(len(entries), calls.FIELDS_COUNT, dtype=torch.float64)
    for (step, _), owners in jobs.items():
        _call(group, [entries[i] for i in owners], step, sums, owners)
    if sums is not None:
        _add_sums(group, entries, sums)
    elif whole_group:
        plan = NativePlan.build(group, entries)
        if plan is not None:
            group.cache[_PLAN] = plan


def _call(group: GroupStep, entries: list[Entry], step: int, sums, owners) -> None:
    """One C call over ``entries`` (one step value and gradient dtype)."""
    rows = []
    for entry in entries:
        keys = (stochastic_key(group.seed, entry.item.position, step)
                if group.strategy.draws else (0, 0))
        # (the first index keys the draws only: 0 for a shard of no flat range, no draws)
        rows.append((entry.native, entry.offset or 0, *keys))
    out = None
    if sums is not None:  # the usual single job over every entry writes in place
        whole = len(owners) == sums.shape[0]
        out = sums if whole else torch.empty(len(rows), calls.FIELDS_COUNT,
                                             dtype=torch.float64)
    scale = None if group.grad_scale is None else float(group.grad_scale)
    calls.adamw(group.strategy, group.coefficients(step), rows, scale=scale,
                maximize=group.maximize, sums=out)
    if out is not None and out is not sums:
        sums[owners] = out


def _add_sums(group: GroupStep, entries: list[Entry], sums: torch.Tensor) -> None:
    """Each entry's row of ``sums`` into its metric keys, once per distinct key: a key
    shared by every entry (``""``, the group's) adds one float64 total."""
    by_key: dict[str, list[int]] = {}
    for position, entry in enumerate(entries):
        for key in dict.fromkeys(entry.item.stat_keys):
            by_key.setdefault(key, []).append(position)
    total = None
    for key, positions in by_key.items():
        if len(positions) == 1:
            row = sums[positions[0]]
        elif len(positions) == len(entries):
            total = sums.sum(0) if total is None else total
            row = total
        else:
            row = sums[positions].sum(0)
        group.stats.add_sums(key, row)
