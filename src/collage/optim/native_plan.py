"""A group's native call, reused from step to step: its pointer table checked, not rebuilt.

Why: the native kernels step the 17M parameters of the ``16m`` benchmark set in about 7 ms
on two cores, but assembling their call in Python cost 10-18 us per tensor (0.7 ms for
that set's 52 tensors, up to 2.7 ms for the 148 of ``100m``, 0.3 ms for the 28 small ones
of ``small``): per tensor the state lookups, device, dtype and contiguity checks, the
table row, and for the step counters a ``_foreach_add_`` (2.7 us per scalar CPU tensor)
plus a ``stack().tolist()``. A step of a small model was mostly that.

A :class:`NativePlan` keeps the last step's table. The next step checks, per tensor, only
what can change between steps and costs about 1 us:

* the parameters with gradients are the same objects in the same order, each with the same
  state dict (``load_state_dict`` makes new ones);
* the weight and every state tensor (the step counter included) still have the data
  pointers of the table, the weight and the gradient are contiguous, the gradient has the
  table's dtype (``p.data = ...``, a replaced state tensor or a non-contiguous gradient
  fail the check);
* the gradient's pointer is read into the table (``zero_grad(set_to_none=True)`` makes new
  gradients every step);
* the group's strategy and ``foreach``/``fused`` flags are unchanged;
* ``stochastic``: the optimizer's seed and parameter positions are those the plan keyed its
  rows with. Each row keeps ``base._mix``'s state after the seed and the position, and C
  mixes the step in (``collage_stochastic_keys``): ``fused.stochastic_key`` in Python cost
  about 3 us per tensor, half of a small model's ``stochastic`` step.

The step counters are advanced in C (``collage_advance_steps``), which first checks that
every one still holds the plan's step value: a counter changed in place by the user fails
the check and nothing is written. Any failed check returns False; the caller then takes
its general path, which rebuilds the plan. The kernel call is the one the general path
makes (same table, coefficients and flags), so the results are bit for bit the same
(``tests/optim/test_native_plan.py``).

Plans are made only for what the fast path needs no more for: unmeasured steps of plain
(non-DTensor) CPU tensors on an OpenMP build of the library, every counter at one step
value below 2**24. A plan holds its group's state dicts, so ``load_state_dict`` drops the
plans first (the old tensors are freed at once). ``COLLAGE_NATIVE_PLAN=0`` turns them off.
"""

from __future__ import annotations

import os
from array import array

import torch

from . import native

__all__ = ["NativePlan", "ENABLED"]

ENABLED = os.environ.get("COLLAGE_NATIVE_PLAN", "1").strip().lower() not in (
    "0", "false", "off", "no")

# float32 step counters count exactly up to 2**24 (then + 1 rounds back: torch's counters
# stop there, and the C check compares floats): plans step while the next count is exact
_MAX_STEP = 2**24


class NativePlan:
    """The native call of one parameter group, for the steps that follow (see the module
    docstring). Build with :meth:`build` after a general native step; :meth:`step` runs
    the next step or returns False having changed nothing."""

    __slots__ = ("lib", "code", "strategy", "stochastic", "foreach", "fused", "params",
                 "states", "keys", "pointers", "table", "counters", "step_value",
                 "grad_dtype", "key_states", "key_of")

    def __init__(self) -> None:  # use build()
        self.step_value = 0

    @classmethod
    def build(cls, optimizer, group: dict, strategy, entries) -> NativePlan | None:
        """A plan from the entries ``fused.step_group`` just stepped natively (all of the
        group's parameters with gradients), or None where the fast path does not apply."""
        lib = native.loaded()
        if not ENABLED or lib is None or not lib.collage_native_openmp() or not entries:
            return None
        first = entries[0]
        keys = tuple(key for key, _ in native._LAYOUTS[strategy.name] if key) + ("step",)
        rows, pointers, counters = [], [], []
        for entry in entries:
            counter = entry.state.get("step")
            if (entry.whole is not entry.param or entry.numel == 0 or entry.offset != 0
                    or entry.step != first.step or entry.step >= _MAX_STEP
                    or entry.grad.dtype != first.grad.dtype or counter is None
                    or counter.dtype != torch.float32 or counter.device.type != "cpu"
                    or counter.numel() != 1):
                return None
            # the gradient and the stochastic keys are rewritten every step
            rows.extend(native.table_row(entry.native, 0, 0, 0))
            pointers.append((entry.whole.data_ptr(),
                             *[entry.state[key].data_ptr() for key in keys]))
            counters.append(counter.data_ptr())
        plan = cls()
        plan.lib = lib
        plan.code = native.STRATEGY_CODES[strategy.name]
        plan.strategy = group["strategy"]
        plan.stochastic = strategy.name == "stochastic"
        if plan.stochastic:  # fused.stochastic_key's state before the step, per row
            plan.key_states = array("Q", [_key_state(optimizer, entry.whole)
                                          for entry in entries])
            plan.key_of = (optimizer.seed, optimizer._parameter_positions())
        plan.foreach, plan.fused = group["foreach"], group["fused"]
        plan.params = [entry.whole for entry in entries]
        plan.states = [entry.state for entry in entries]
        plan.keys = keys
        plan.pointers = pointers
        plan.table = array("q", rows)
        plan.counters = array("q", counters)
        plan.step_value = first.step
        plan.grad_dtype = first.grad.dtype
        return plan

    def step(self, optimizer, group: dict, items, grad_scale) -> bool:
        """Step ``items`` (``(name, param, grad)``, the group's parameters with gradients)
        if the plan still describes them; False (nothing changed) otherwise."""
        if (len(items) != len(self.params) or self.step_value >= _MAX_STEP
                or group["strategy"] != self.strategy
                or group["foreach"] is not self.foreach or group["fused"] is not self.fused):
            return False
        grads = self._gradient_pointers(optimizer, items)
        if grads is None:
            return False
        columns = native.TABLE_COLUMNS
        self.table[native.COLUMN_GRAD::columns] = grads
        step = self.step_value + 1
        if self.stochastic:  # the draws' keys depend on the step: mixed in by C
            seed, positions = self.key_of
            if optimizer.seed != seed or optimizer._parameter_positions() is not positions:
                return False  # a new seed or parameter order: new key states
            self.lib.collage_stochastic_keys(len(self.params), self.table.buffer_info()[0],
                                             self.key_states.buffer_info()[0], step)
        scale = None if grad_scale is None else float(grad_scale)
        flags, h = native.arguments(optimizer.rule.coefficients(group, step), scale,
                                    bool(group.get("maximize", False)),
                                    self.grad_dtype == torch.float32)
        if not native.advance_steps(self.lib, self.counters, float(self.step_value)):
            return False  # a counter was changed: the general path reads them all
        native.call_threads(self.lib, self.code, flags, len(self.params), self.table, h,
                            torch.get_num_threads())
        self.step_value = step
        return True

    def _gradient_pointers(self, optimizer, items) -> array | None:
        """The gradients' data pointers, or None if a check of the module docstring fails."""
        state_of, keys, grad_dtype = optimizer.state, self.keys, self.grad_dtype
        grads = array("q")
        for (_, param, grad), known, state, pointers in zip(items, self.params, self.states,
                                                            self.pointers):
            if (param is not known or state_of.get(param) is not state
                    or grad.dtype != grad_dtype or not grad.is_contiguous()
                    or not param.is_contiguous()):
                return None
            try:
                now = (param.data_ptr(), *[state[key].data_ptr() for key in keys])
            except KeyError:
                return None
            if now != pointers:
                return None
            grads.append(grad.data_ptr())
        return grads


def _key_state(optimizer, param) -> int:
    """``base._mix``'s state after the seed and ``param``'s position: what
    ``fused.stochastic_key`` mixes the step into (``collage_stochastic_keys`` does that)."""
    from .base import _MIX_START, _mix_state

    return _mix_state(_MIX_START, optimizer.seed, optimizer._parameter_positions()[id(param)])
