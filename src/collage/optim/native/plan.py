"""A group's native call, reused from step to step: its pointer table checked, not rebuilt.

Why: assembling a native call in Python costs far more per tensor than the kernel spends
on a small tensor: per tensor the state lookups, device, dtype and contiguity checks, the
table row, and for the step counters a ``_foreach_add_`` plus a ``stack().tolist()``. A
step of a small model was mostly that (``docs/strategies.md`` has the numbers).

A :class:`NativePlan` keeps the last step's table. The next step checks, per tensor, only
what can change between steps:

* the parameters with gradients are the same objects in the same order, each with the same
  state dict (``load_state_dict`` makes new ones);
* the weight and every state tensor (the step counter included) still have the data
  pointers of the table, the weight and the gradient are contiguous, both have the table's
  dtype and shape (``p.data = ...``, a view of the weight's own memory included, a replaced
  state tensor or a non-contiguous gradient fail the check); each check one pass in C over
  the tensors (``plan_table.PlanTable``), not a Python loop;
* the gradient's pointer is read into the table (``zero_grad(set_to_none=True)`` makes new
  gradients every step);
* the group's strategy and its path flags (``foreach``, ``fused``, ``reference``,
  ``capturable``) are the plan's: a flag set since chooses the path again;
* ``stochastic``: the seed and parameter positions are those the plan keyed its rows with.
  Each row keeps ``draws.mix``'s state after the seed and the position, and C mixes the
  step in (``collage_stochastic_keys``) instead of Python.

One C call (``collage_adamw_planned``, :func:`step_plans`) steps every group of a step
that its plan steps, and advances the step counters, which it first checks all still hold
their plans' step values: a counter changed in place by the user fails the check and
nothing is written. With ``check`` (``nonfinite="skip"`` or ``"raise"``) the same call
reads every gradient of every group for inf and nan before any thread writes, in the
threads that step them. Any failed check writes nothing; the caller then takes its
general path, which rebuilds the plan. The kernels are the general path's (same table,
coefficients and flags), so the results are bit for bit the same
(``tests/optim/test_native_plan.py``).

Plans are made only for what the fast path needs no more for: unmeasured steps of plain
(non-DTensor) CPU tensors on an OpenMP build of the library, every counter at one step
value below 2**24. A plan holds its group's state dicts; it lives in the group's cache,
which ``load_state_dict`` empties (the old tensors are freed at once).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ..draws import MIX_START, mix_state
from ..group import ITEM_POSITION, Entry, GroupStep
from ..plan_table import PlanTable
from . import calls
from .build import loaded

__all__ = ["NativePlan", "step_plans"]

# float32 step counters count exactly up to 2**24 (then + 1 rounds back: torch's counters
# stop there, and the C check compares floats): plans step while the next count is exact
_MAX_STEP = 2**24


class NativePlan:
    """The native call of one parameter group, for the steps that follow (see the module
    docstring). Build with :meth:`build` after a general native step; :meth:`step` runs
    the next step or returns False having changed nothing."""

    __slots__ = ("lib", "strategy", "flags", "tensors", "table", "counters", "step_value",
                 "grad_dtype", "key_states", "key_of", "elements")

    def __init__(self) -> None:  # use build()
        self.step_value = 0
        self.key_states = self.key_of = None

    @classmethod
    def build(cls, group: GroupStep, entries: list[Entry]) -> NativePlan | None:
        """A plan from the entries just stepped natively (all of the group's parameters
        with gradients), or None where the fast path does not apply."""
        lib = loaded()
        if lib is None or not lib.collage_native_openmp() or not entries:
            return None
        first = entries[0]
        keys = tuple(key for key, _ in calls.row_layout(group.rule, group.strategy)
                     if key) + ("step",)
        rows, counters = [], []
        for entry in entries:
            if not _plannable(entry, first):
                return None
            # the gradient and the stochastic keys are rewritten every step
            rows.extend(calls.table_row(entry.native, 0, 0, 0))
            counters.append(entry.state["step"].data_ptr())
        plan = cls()
        plan.lib = lib
        plan.strategy = group.strategy
        plan.flags = _flags(group)
        if group.strategy.draws:  # draws.mix's state before the step, per row
            positions = _positions([entry.item for entry in entries])
            plan.key_states = array("Q", [mix_state(MIX_START, group.seed, p)
                                          for p in positions])
            plan.key_of = (group.seed, positions)
        plan.tensors = PlanTable([entry.item for entry in entries], keys)
        plan.table = array("q", rows)
        plan.elements = sum(plan.table[calls.COLUMN_NUMEL::calls.TABLE_COLUMNS])
        plan.counters = array("q", counters)
        plan.step_value = first.step
        plan.grad_dtype = first.grad.dtype
        return plan

    def ready(self, group: GroupStep) -> array | None:
        """The gradients' data pointers if the plan still describes the group's items (the
        checks of the module docstring), else None. Changes nothing."""
        items = group.items
        if (len(items) != len(self.tensors.params) or self.step_value >= _MAX_STEP
                or group.strategy is not self.strategy or _flags(group) != self.flags):
            return None
        if self.key_of is not None and self.key_of != (group.seed, _positions(items)):
            return None  # a new seed or parameter order: new key states
        grads = self.tensors.gradients(items)
        return None if grads is None else array("q", map(torch.Tensor.data_ptr, grads))

    def step(self, group: GroupStep, grads: array) -> bool:
        """Step the group with the gradient pointers :meth:`ready` returned; False (nothing
        changed) when a step counter was changed since the plan's step."""
        return step_plans([(self, group, grads)], check=False) is True

    def call(self, group: GroupStep, grads: array) -> tuple[array, array]:
        """The group's row of ``collage_adamw_planned`` (native.h: P_*) for its next step
        with the gradient pointers :meth:`ready` returned, and the coefficients it points
        to (keep them alive until the call). Writes only the plan's own table."""
        self.table[calls.COLUMN_GRAD::calls.TABLE_COLUMNS] = grads
        step = self.step_value + 1
        if self.key_of is not None:  # the draws' keys depend on the step: mixed in by C
            self.lib.collage_stochastic_keys(len(self.counters), self.table.buffer_info()[0],
                                             self.key_states.buffer_info()[0], step)
        scale = None if group.grad_scale is None else float(group.grad_scale)
        flags, h = calls.arguments(group.coefficients(step), scale, group.maximize,
                                   self.grad_dtype == torch.float32)
        rows = len(self.counters)  # a row and a step counter per tensor
        row = array("q", (self.strategy.native_code, flags, rows, self.elements,
                          self.table.buffer_info()[0], h.buffer_info()[0], rows,
                          self.counters.buffer_info()[0], self.step_value))
        return row, h


#: collage_adamw_planned's outcomes (native.h)
_STEPPED, _NONFINITE, _COUNTER_CHANGED = 0, 1, 2


def step_plans(runs: Sequence[tuple[NativePlan, GroupStep, array]], check: bool
               ) -> bool | None:
    """Step every ``(plan, group, gradient pointers from plan.ready(group))`` in one C call
    (``collage_adamw_planned``: one OpenMP region for every group); with ``check``, first
    every gradient of every group read for inf and nan, as the non-finite check reads them.
    True: stepped, each plan's step advanced. False (only with ``check``): a gradient
    holds inf or nan; None: a step counter was changed since its plan's step (the caller
    takes the general path, which reads them all). On False and None nothing was written
    but the plans' own tables."""
    rows, keep = array("q"), []
    for plan, group, grads in runs:
        row, h = plan.call(group, grads)
        rows.extend(row)
        keep.append(h)
    lib = runs[0][0].lib
    outcome = lib.collage_adamw_planned(len(runs), rows.buffer_info()[0],
                                        torch.get_num_threads(), int(check))
    if outcome == _STEPPED:
        for plan, _, _ in runs:
            plan.step_value += 1
        return True
    if outcome == _NONFINITE:
        return False
    if outcome == _COUNTER_CHANGED:
        return None
    raise RuntimeError(f"collage_adamw_planned returned {outcome}")  # pragma: no cover


def _positions(items) -> tuple[int, ...]:
    """The items' parameter positions (one pass in C: this runs every step)."""
    return tuple(map(ITEM_POSITION, items))


def _flags(group: GroupStep) -> tuple:
    """What ``dispatch.choose`` chose the path from besides the tensors: a change of any
    sends the step to the general path, which chooses again."""
    return (group.foreach, group.fused, group.reference,
            bool(group.hyper.get("capturable", False)))


def _plannable(entry: Entry, first: Entry) -> bool:
    """Whether ``entry`` can be a row of a plan whose first row is ``first``."""
    counter = entry.state.get("step")
    return (entry.item.param is entry.param and entry.numel > 0 and entry.offset == 0
            and entry.step == first.step and entry.step < _MAX_STEP
            and entry.grad.dtype == first.grad.dtype and counter is not None
            and counter.dtype == torch.float32 and counter.device.type == "cpu"
            and counter.numel() == 1)
