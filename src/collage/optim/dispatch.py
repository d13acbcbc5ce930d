"""The one dispatch: which implementation steps a parameter group.

:func:`choose` decides from plain data (the flags, the tensors' device, the rule and
strategy), like ``torch.optim``'s ``_default_to_fused_or_foreach``; :func:`step_group` runs
the choice. The paths compute the same float32 arithmetic (``kernels.fast_step``) except
``reference``:

=============  =========================================  ===============================
path           selected by                                what runs
=============  =========================================  ===============================
``reference``  ``reference=True``                         op by op in the weight dtype
``per_tensor`` ``foreach=False``                          eager torch ops, tensor by tensor
``foreach``    ``foreach=True``; the default where         eager, small tensors batched
               nothing faster covers the group
``native``     CPU, ``fused=True`` or default, where the  hand-written C (``native/``)
               native kernels cover the group
``triton``     ``fused="triton"``; ``fused=True`` and the  hand-written Triton kernels,
               default on CUDA, where the Triton kernels  multi-tensor (``triton/``); on
               cover the group; ``capturable=True``       CPU through the interpreter
``compiled``   ``fused=True`` elsewhere; the default on   torch.compile (inductor: C++ on
               CUDA where ``triton`` does not cover       CPU, Triton on GPU)
=============  =========================================  ===============================

``fused="triton"`` where the Triton kernels cannot run (no Triton, CPU tensors without
``TRITON_INTERPRET=1``, a group they do not cover) runs what ``fused=True`` runs, with one
warning. A compiled path that cannot compile (no C++ compiler, no Triton, an inductor
failure) runs ``foreach`` with one warning. Tensors a fast path cannot take (not contiguous, on
another device than the group's first, a shard that is not one flat range where the
strategy draws) run the eager kernel one by one, with the same arithmetic.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import compiled, eager, native
from .group import ITEM_PARAM, Entry, GroupStep, entries_of, local
from .native import path as native_path
from .triton import path as triton_path

__all__ = ["PATHS", "Prepared", "choose", "verdict_on_device", "prepare", "checks_planned",
           "check_planned", "run", "step_group"]

PATHS = ("reference", "per_tensor", "foreach", "native", "compiled", "triton")


def choose(group: GroupStep, device: torch.device) -> str:
    """The path of ``group`` whose tensors are on ``device`` (see the module table)."""
    if _takes_triton(group, device, warn=True):
        return "triton"
    if group.reference:
        return "reference"
    if group.foreach is not None and not group.fused:
        return "foreach" if group.foreach else "per_tensor"
    if group.fused is not False and device.type == "cpu" and _native_covers(group):
        return "native"
    if group.fused or (group.fused is None and device.type == "cuda"):
        if compiled.available():
            return "compiled"
        if group.fused:
            group.warn("torch.compile has no C++ compiler or Triton here; using the foreach "
                       "path (same float32 arithmetic, not compiled)")
    return "per_tensor" if group.foreach is False else "foreach"


def verdict_on_device(group: GroupStep) -> bool:
    """Whether ``group``'s step can take the non-finite check's verdict on the device: its
    path is the Triton kernels, which read it there and write nothing when it is set, so
    that the step never waits for the device (``docs/gpu.md``). GradScaler's verdict and
    measured steps are read on the host."""
    if not group.items:
        return True
    if group.grad_scale is not None or group.stats is not None:
        return False
    # choose()'s first question only: the rest of it (the native kernels' coverage, a
    # check of every tensor) cannot make the answer "triton" and cost a small model's step
    # about 100 us per call (#31)
    return _takes_triton(group, local(group.items[0].param).device, warn=False)


def _takes_triton(group: GroupStep, device: torch.device, warn: bool) -> bool:
    """Whether :func:`choose` picks the Triton kernels (its first rows of the module
    table): ``capturable=True`` (a RuntimeError where they cannot run), or ``fused=
    "triton"``, or ``fused`` not False on CUDA, where they cover the group. ``warn``: tell
    the group why ``fused="triton"`` runs something else."""
    if group.hyper.get("capturable", False):
        reason = triton_path.unavailable(group, device)
        if reason is not None:
            raise RuntimeError(f"capturable=True runs the Triton kernels only: {reason}")
        return True
    if group.reference or (group.foreach is not None and not group.fused):
        return False
    if group.fused == "triton" or (group.fused is not False and device.type == "cuda"):
        reason = triton_path.unavailable(group, device)
        if reason is None:
            return True
        if warn and group.fused == "triton":
            group.warn(f"fused='triton': {reason}; running what fused=True runs")
    return False


def _native_covers(group: GroupStep) -> bool:
    return native.covers(group.rule, group.strategy, [local(i.param) for i in group.items],
                         [local(i.grad) for i in group.items])


@dataclass
class Prepared:
    """A group's step, checked and ready to run: its path, and its entries or the native
    or Triton plan's gradient pointers. ``by_plan``: set by :func:`run` when the plan
    stepped the group (its kernels wrote through pointers; :func:`run` then moved each
    weight's version counter by exactly one, as an in-place torch operation does)."""

    group: GroupStep
    path: str
    entries: list[Entry] = field(default_factory=list)
    plan_grads: array | list[int] | None = None
    by_plan: bool = False


def prepare(group: GroupStep) -> Prepared | None:
    """Check ``group``'s items and choose its path, changing nothing but creating the state
    of parameters that have none (None for an empty group). Every check that can fail runs
    here, so a caller preparing every group first steps all or none."""
    if not group.items:
        return None
    grads = native_path.planned(group)
    if grads is not None:
        return Prepared(group, "native", plan_grads=grads)
    grads = triton_path.planned(group)
    if grads is not None:
        return Prepared(group, "triton", plan_grads=grads)
    entries = entries_of(group)
    return Prepared(group, choose(group, entries[0].param.device), entries)


def prepare_native_plans(groups: Sequence[GroupStep]) -> list[Prepared | None] | None:
    """What :func:`prepare` gives every group (None for an empty one) if each group with
    items has a native plan that still describes it (``native_path.planned``), and one
    does; else None. Creates nothing (a plan no longer ready is dropped, as
    :func:`prepare` drops it): a step refused after it has changed nothing.
    :func:`step_native_plans` then checks and steps every group in one C call."""
    out: list[Prepared | None] = []
    for group in groups:
        if not group.items:
            out.append(None)
            continue
        grads = native_path.planned(group)
        if grads is None:
            return None
        out.append(Prepared(group, "native", plan_grads=grads))
    return out if any(out) else None


def step_native_plans(prepared: Sequence[Prepared | None], check: bool) -> bool | None:
    """Step every group :func:`prepare_native_plans` prepared, in one C call
    (``native_path.step_plans``); with ``check``, not before every gradient of every group
    was read for inf and nan. True: stepped (each ``by_plan``); False: a gradient holds inf
    or nan; None: a step counter was changed since its plan's step. On False and None
    nothing was written."""
    runs = [p for p in prepared if p is not None]
    stepped = native_path.step_plans([(p.group, p.plan_grads) for p in runs], check)
    if stepped:
        for p in runs:
            p.by_plan = True
            _written_through_pointers(p.group)
    return stepped


def checks_planned(prepared: Prepared) -> bool:
    """Whether the prepared group's plan checks its gradients for the device's non-finite
    verdict itself (a Triton plan: :func:`check_planned`)."""
    return prepared.path == "triton" and prepared.plan_grads is not None


def check_planned(prepared: Prepared, found: torch.Tensor) -> None:
    """Raise the device verdict ``found`` (zeroed or written before) to 1 where the
    gradients of a group :func:`checks_planned` hold inf or nan: its plan's kernels."""
    triton_path.check_planned(prepared.group, prepared.plan_grads, found)


def run(prepared: Prepared) -> str:
    """Step a prepared group; returns the path that ran."""
    group = prepared.group
    if prepared.plan_grads is not None:
        if _PLANNED[prepared.path](group, prepared.plan_grads):
            prepared.by_plan = True
            _written_through_pointers(group)
            return prepared.path
        prepared = prepare(group)  # a step counter was changed in place since
    _RUNNERS[prepared.path](group, prepared.entries)
    if prepared.path in _THROUGH_POINTERS:
        _written_through_pointers(group)
    return prepared.path


#: the paths whose kernels write the weights through their pointers, unseen by autograd
_THROUGH_POINTERS = frozenset({"native", "triton"})


def _written_through_pointers(group: GroupStep) -> None:
    """Move each weight's version counter, as torch's in-place operations do: autograd
    then refuses a backward through a graph that saved the weights before this step
    (``retain_graph=True``, then ``step()``, then ``backward()``), as it refuses after
    ``torch.optim``, and caches keyed on ``_version`` see the change. One C loop over the
    group (what ``torch.autograd.graph.increment_version`` calls, without its Python
    wrapper: this runs every step); ``edits.WriteLog.bumped`` keeps the optimizer's own
    records in step."""
    torch._C._increment_version(list(map(ITEM_PARAM, group.items)))


def step_group(group: GroupStep) -> str | None:
    """Step every item of ``group`` (all have gradients); returns the path that ran (None
    for an empty group)."""
    prepared = prepare(group)
    return None if prepared is None else run(prepared)


def _step_native(group: GroupStep, entries: list[Entry]) -> None:
    covered = native_path.native_entries(group, entries)
    native_path.step_native(group, covered, whole_group=len(covered) == len(entries))
    _step_rest(group, entries, covered)


def _step_compiled(group: GroupStep, entries: list[Entry]) -> None:
    device = entries[0].param.device
    fit = [e for e in entries if e.offset is not None and e.contiguous_on(device)]
    if fit:
        if group.stats is not None:
            compiled.step_compiled_measured(group, fit)
        else:
            compiled.step_compiled(group, fit)
    _step_rest(group, entries, fit)


def _step_rest(group: GroupStep, entries: list[Entry], done: list[Entry]) -> None:
    """The entries a fast path left (rare layouts): the eager kernel, one by one."""
    stepped = {id(entry) for entry in done}
    for entry in entries:
        if id(entry) not in stepped:
            eager.step_one(group, entry, reference=False)


_PLANNED = {"native": native_path.step_planned, "triton": triton_path.step_planned}
_RUNNERS = {"reference": eager.step_reference, "per_tensor": eager.step_per_tensor,
            "foreach": eager.step_foreach, "native": _step_native, "compiled": _step_compiled,
            "triton": triton_path.step_triton}
