"""A group's Triton step, reused from step to step: its launches checked, not rebuilt (as
``native/plan.py`` does for the C kernels).

Why: on a GPU the kernels of a 100M-parameter step take about half a millisecond, and the
general path spends about as much per ten tensors in Python (per tensor the state checks,
the entry, the bucket, the table's signature, and the step counters' ``stack().tolist()``).
A :class:`TritonPlan` keeps the last step's launches; the next step checks, per tensor,
only what can change between steps:

* the parameters with gradients are the same objects in the same order, each with the same
  state dict (``load_state_dict`` and a strategy conversion make new ones), the group's
  rule, strategy, flags, seed and parameter positions are the plan's;
* the weight and every state tensor still have the table's addresses, the weight and the
  gradient are contiguous, both have the table's dtype and shape (so the gradient has its
  parameter's device: torch keeps a gradient on its parameter's), and is on 16 bytes where
  the launch was told so; each check one pass in C over the tensors
  (``plan_table.PlanTable``);
* each state's step counter is the plan's object, and none was written since the plan
  advanced it (its version counter, which every in-place write bumps: a counter set by hand
  or replaced sends the step to the general path).

The gradients' addresses are then read, the counters advanced and the launches run with
the coefficients of the plan's next step: the general path's launches, so the results are
bit for bit the same (``tests/optim/test_triton.py``). Plans are made for unmeasured steps
of plain tensors whose counters are float32 scalars, made the elements of one vector
(``launch.gather_counters``: each state's ``step`` a 0-d view of it) so that one operation
advances them all: on the host, all at one step value below 2**24, advanced by one
``add_``; or, ``on_device`` (capturable, or the non-finite verdict left on the device: the
default), on the parameters' device, advanced there by ``1 - verdict``, the coefficients
computed there once (``launch.DeviceCoefficients``) and the gradients checked by the plan's
kernels (:meth:`TritonPlan.check`): the same host and device work for 3 tensors as for
300, but for the checks of ``plan_table``.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import is_

import torch

from ..group import ITEM_POSITION, Entry, GroupStep
from ..plan_table import PlanTable
from . import launch as launches
from . import layout

__all__ = ["Bucket", "TritonPlan", "on_device"]

# float32 step counters count exactly up to 2**24 (then + 1 rounds back to itself)
_MAX_STEP = 2**24

#: (launch, the bucket's positions in the group's entries, weight dtype)
Bucket = tuple[launches.Launch, list[int], torch.dtype]


def _flags(group: GroupStep) -> tuple:
    """What the dispatch chose the path from, and what keys the draws: a change of any
    sends the step to the general path."""
    return (group.rule, group.strategy, group.foreach, group.fused, group.reference,
            bool(group.hyper.get("capturable", False)), group.seed,
            tuple(map(ITEM_POSITION, group.items)))


class TritonPlan:
    """The Triton launches of one parameter group, for the steps that follow (see the
    module docstring). Build with :meth:`build` after a general step; :meth:`ready` checks,
    :meth:`step` runs."""

    __slots__ = ("flags", "table", "counters", "vector", "versions", "device", "buckets",
                 "aligned", "all_aligned", "step_value", "on_device", "coefficients",
                 "pointed")

    @classmethod
    def build(cls, group: GroupStep, entries: list[Entry], buckets: list[Bucket],
              on_device: bool = False) -> TritonPlan | None:
        """A plan from the entries just stepped (every parameter of the group with a
        gradient) by ``buckets``, or None where the fast path does not apply."""
        if not entries or len(entries) != len(group.items) or group.stats is not None:
            return None
        first = entries[0]
        if not all(_plannable(entry, first, on_device) for entry in entries):
            return None
        plan = cls()
        plan.on_device = on_device
        plan.flags = _flags(group)
        plan.table = PlanTable([entry.item for entry in entries], tuple(first.tensors))
        plan.coefficients = plan.pointed = None
        if on_device:  # one vector in bucket order (path._step_on_device made it)
            plan.vector = launches.counter_vector(
                [entries[i].state["step"] for _, members, _ in buckets for i in members])
            if plan.vector is None:
                return None
            plan.coefficients = launches.DeviceCoefficients(len(entries), plan.vector.device)
        else:  # on the host: made one vector there now (the values kept)
            plan.vector = launches.gather_counters(entries, torch.device("cpu"))
        plan.counters = [entry.state["step"] for entry in entries]
        plan.versions = plan.vector._version
        plan.device = first.param.device
        plan.buckets = buckets
        plan.aligned = [False] * len(entries)
        for launch, members, _ in buckets:
            for member in members:
                plan.aligned[member] = launch.aligned
        plan.all_aligned = all(plan.aligned)
        plan.step_value = first.step
        return plan

    def ready(self, group: GroupStep) -> list[int] | None:
        """The gradients' addresses if the plan still describes the group (the checks of the
        module docstring), else None. Changes nothing. Each check is one pass over the
        tensors in C (``plan_table.PlanTable``), not a Python loop: this runs every step."""
        if self.step_value + 1 >= _MAX_STEP:
            return None
        if self.on_device != on_device(group) or _flags(group) != self.flags:
            return None
        if self.vector._version != self.versions:
            return None  # a counter was written since: the general path reads them all
        grads = self.table.gradients(group.items)
        if grads is None or not all(map(is_, map(dict.get, self.table.states,
                                                 repeat("step")), self.counters)):
            return None
        addresses = list(map(torch.Tensor.data_ptr, grads))
        if not launches.on_16_bytes(addresses if self.all_aligned
                                    else compress(addresses, self.aligned)):
            return None
        return addresses

    def step(self, group: GroupStep, grads: list[int]) -> None:
        """Step the group with the gradients' addresses :meth:`ready` returned."""
        if self.on_device:
            self._step_on_device(group, grads)
            return
        self.vector.add_(1.0)
        self.versions = self.vector._version
        step = self.step_value + 1
        coefficients = group.coefficients(step)
        arguments = launches.step_arguments(group.rule, coefficients)
        scale = launches.grad_scale(group, self.device)
        self._point_at(grads)
        for launch, _, dtype in self.buckets:
            flags = launches.kernel_flags(group, dtype, launches.decays(coefficients), False,
                                          self.device.type == "cpu")
            launches.launch(launch, flags, arguments, step, None, scale)
        self.step_value = step

    def check(self, grads: list[int], found: torch.Tensor) -> None:
        """Raise the step's device verdict ``found`` to 1 where a gradient at ``grads``
        (:meth:`ready`'s addresses) holds inf or nan: one check launch per bucket (its
        whole blocks and its tails), whatever the number of tensors."""
        self._point_at(grads)
        for launch, _, dtype in self.buckets:
            launches.check(launch, dtype, found)

    def _point_at(self, grads: list[int]) -> None:
        """Every bucket's launch pointed at the gradients at ``grads`` (:meth:`ready`'s
        addresses, a new list each step): once a step, which the check and the step share."""
        if grads is self.pointed:
            return
        for launch, members, _ in self.buckets:
            launches.refresh_grads(launch, [grads[i] for i in members])
        self.pointed = grads

    def _step_on_device(self, group: GroupStep, grads: list[int]) -> None:
        """The counters advanced on the device by ``1 - verdict`` (one operation on their
        vector), the coefficients computed there once, each bucket launched with its rows
        and told the verdict."""
        found = group.found_nonfinite
        launches.advance_counters(self.vector, found)
        self.versions = self.vector._version
        coefficients = self.coefficients.update(group, self.vector)
        scale = launches.grad_scale(group, self.device)
        decays = launches.capturable_decays(group)
        interpreted = self.device.type == "cpu"
        self._point_at(grads)
        start = 0
        for launch, members, dtype in self.buckets:
            flags = launches.kernel_flags(group, dtype, decays, True, interpreted,
                                          skippable=found is not None)
            launches.launch(launch, flags, [0.0] * layout.NCOEF, 0,
                            coefficients[start:start + len(members)], scale, found)
            start += len(members)


def on_device(group: GroupStep) -> bool:
    """Whether the group's step keeps its counters on the device: capturable, or the
    non-finite verdict left there."""
    return bool(group.hyper.get("capturable", False)) or group.found_nonfinite is not None


def _plannable(entry: Entry, first: Entry, device_counters: bool) -> bool:
    """Whether ``entry`` can be stepped by a plan whose first entry is ``first``."""
    counter = entry.state.get("step")
    if counter is None or counter.dtype != torch.float32 or counter.numel() != 1:
        return False
    if device_counters:
        where = counter.device == entry.param.device
    else:
        where = counter.device.type == "cpu" and entry.step == first.step < _MAX_STEP
    return (where and entry.item.param is entry.param and entry.offset == 0
            and tuple(entry.tensors) == tuple(first.tensors))
