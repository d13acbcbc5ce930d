"""Measured steps on the fused path: the step and its lost-update sums in one compiled call.

On CPU, groups the native kernels cover (``native.covers``: AdamW, the eight 16-bit
strategies) never get here: ``fused.step_group`` measures them with the native measured
kernel (``native.adamw(..., sums=...)``), with the semantics of the CPU kernel below, also
on the default path (``fused=None``). This module serves the rest: CUDA, SGD and Lion,
``plus8``, fp16 weights, and CPU where no C compiler is found.

A measured step needs, per tensor, the represented value before and after, the visible
weight before and after, and the intended update. Materialising those in float64 costs
about 40 bytes per parameter of extra traffic; here they live only in registers: the
compiled kernel reads the components once, performs the step, and reduces the 11 sums of
``collage.metrics.FIELDS`` in the same pass. Each parameter gets its own calls (no batching
of small tensors) so that per-parameter keys stay exact.

Two kernels, by device:

* CUDA (and any non-CPU device): float64 throughout (``collage.metrics.update_sums``): the
  conversions are single instructions there and the step is memory-bound.
* CPU: inductor converts float32 to float64 one element at a time (ATen has no vectorised
  AVX-512 float->double conversion), which made a measured step cost 3-5x an unmeasured
  one. The CPU kernel therefore stays in float32 per element -- the intended update in
  float32, the changes with an exact zero test (``collage.metrics.component_change``) -- and
  sees each tensor as ``(rows, BLOCK)`` plus a ``(1, rest)`` tail: rows are summed in float32
  and only the row sums are converted and added in float64
  (``collage.metrics.update_sums_blocked``, which states the error bound). Counts stay exact.
  Strategies outside :data:`_PARTS` (state not shaped like the weight) take the float64
  kernel on every device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..metrics import FIELDS, component_change, update_sums, update_sums_blocked
from ..metrics.stats import BLOCK
from . import fused, kernels

__all__ = ["step_group_tracked"]


def _body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    stochastic = strategy.name == "stochastic"

    def step(param, grad, state, packed, static, scale, seeds):
        coeffs, g = fused.kernel_inputs(grad, packed, static, scale, scaled, maximize)
        before = kernels.represented_value(strategy, param, state)
        visible_before = param.double()
        # stochastic: its uniforms; plus8 draws its two streams inside fast_step from the
        # seeds themselves (the same draws as an unmeasured step)
        draws = fused.counter_uniform(param.numel(), seeds) if stochastic else seeds
        intended = kernels.fast_step(rule, strategy, param, g, state, coeffs, draws, True)
        after = kernels.represented_value(strategy, param, state)
        return update_sums(intended, after - before, param.double() - visible_before,
                           kernels.compensation_of(strategy, state))

    return step


#: Strategies the CPU kernel knows (every state tensor is shaped like the weight), and
#: whether their visible weight is a separate value from the represented one.
_PARTS = {"fp32": False, "bf16": False, "stochastic": False, "mixed": True, "split": True,
          "light": True, "plus": True, "kahan": True}


def _blocked_body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    """The CPU kernel: every tensor is a ``(rows, cols)`` view with ``cols <= BLOCK``."""
    stochastic = strategy.name == "stochastic"
    separate_visible = _PARTS[strategy.name]

    def step(param, grad, state, packed, static, scale, seeds, row_ones):
        coeffs, g = fused.kernel_inputs(grad, packed, static, scale, scaled, maximize)
        # row_ones: (rows, 1) float32 ones. Multiplying by it is exact and changes nothing,
        # but its per-row indexing keeps inductor from flattening the step's loops to 1-d,
        # so that they fuse with the per-row reductions (else the update and the new weight
        # go through memory: 1.5-2.5x slower)
        g = g * row_ones
        before = [t.to(torch.float32, copy=True)
                  for t in kernels.represented_parts(strategy, param, state)]
        visible_before = param.to(torch.float32, copy=True) if separate_visible else None
        draws = (fused.counter_uniform(param.numel(), seeds).view(param.shape)
                 if stochastic else None)
        intended = kernels.fast_step(rule, strategy, param, g, state, coeffs, draws, True,
                                     intended_dtype=torch.float32)
        after = [t.float() for t in kernels.represented_parts(strategy, param, state)]
        e, stuck = component_change(before, after)
        ev = stuck_visible = None
        if separate_visible:
            ev, stuck_visible = component_change([visible_before], [param.float()])
        return update_sums_blocked(intended, e, stuck, ev, stuck_visible,
                                   kernels.compensation_of(strategy, state))

    return step


# Inductor stores a reused intermediate to memory once its expression exceeds
# ``realize_cpu_opcount_threshold`` operations. The measured step's landing (new weight and
# its low part) is larger than that and is read by the step and by several sums; stored, it
# splits the kernel into passes through memory (light, kahan, plus: about 2x slower). With
# the threshold out of reach it is recomputed in registers inside one loop instead.
_CPU_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 100_000,
                         "realize_cpu_opcount_threshold": 100_000}

_kernels: dict[tuple, tuple[Callable, Callable]] = {}


def _kernel(rule, strategy, scaled: bool, maximize: bool,
            blocked: bool) -> tuple[Callable, Callable]:
    key = (rule.name, strategy.name, scaled, maximize, blocked)
    if key not in _kernels:
        body = (_blocked_body if blocked else _body)(rule, strategy, scaled, maximize)
        name = f"collage_{rule.name}_{strategy.name}_measured" + ("_cpu" if blocked else "") \
            + ("_scaled" if scaled else "") + ("_max" if maximize else "")
        compiled = fused._compile(body, name, _CPU_INDUCTOR_OPTIONS if blocked else None)
        _kernels[key] = (compiled, body)
    return _kernels[key]


def step_group_tracked(optimizer, index: int, group: dict, strategy, items, grad_scale,
                       stats) -> bool:
    """Step and measure every parameter of ``group`` on the fused path; False (nothing done)
    when the group is not on the fused path or compilation is unavailable."""
    if not items:
        return True
    device = fused._local(items[0][1]).device
    if optimizer._path(group, device) != "fused" or not fused.available():
        return False
    rule = optimizer.rule
    optimizer._fused_backend = "inductor"
    scaled, maximize = grad_scale is not None, bool(group.get("maximize", False))
    blocked = _blocked(device, strategy)
    compiled, eager = _kernel(rule, strategy, scaled, maximize, blocked)
    scale = grad_scale.to(device) if scaled else None
    for name, param, grad in items:
        state = optimizer.state[param]
        if not state:
            kernels.init_state(rule, strategy, param, state)
        local_param, local_grad = fused._local(param), fused._local(grad)
        tensors = {k: fused._local(v) for k, v in state.items() if k != "step"}
        if not all(t.is_contiguous() and t.device == device
                   for t in (local_param, local_grad, *tensors.values())):
            optimizer._step_param(index, group, strategy, name, param, grad, grad_scale, stats)
            continue
        state["step"] += 1
        step = int(state["step"].item())
        packed, static = fused._pack(rule, rule.coefficients(group, step), device)
        offset = fused._flat_offset(param, local_param)
        keyed = strategy.name == "stochastic" or strategy.eight_bit
        if keyed and offset is None:  # shard not one flat range
            state["step"] -= 1
            optimizer._step_param(index, group, strategy, name, param, grad, grad_scale, stats)
            continue
        ranges = _ranges(local_param.numel()) if blocked else [(0, local_param.numel(), None)]
        sums = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        for start, stop, cols in ranges:
            seeds = None
            if keyed:  # the same draws as an unmeasured step
                seeds = fused.stochastic_seeds(optimizer, param, step, offset + start, device)
            args = _call_args(local_param, local_grad, tensors, start, stop, cols)
            sums += _run(optimizer, compiled, eager, (*args[:3], packed, static, scale, seeds,
                                                      *args[3:]))
        stats.add_sums(optimizer._stat_keys(index, group, name), sums)
    return True


def _call_args(param, grad, flat_state, start: int, stop: int, cols: int | None) -> tuple:
    """(param, grad, state[, row_ones]) of one call: elements ``start:stop``, as ``(rows,
    cols)`` views with a ``(rows, 1)`` float32 ones tensor for the CPU kernel."""
    def part(t: torch.Tensor) -> torch.Tensor:
        t = t.view(-1)[start:stop]
        # detach: the same memory without a view base, on which dynamo would guard (and
        # recompile for every parameter shape)
        return t if cols is None else t.view(-1, cols).detach()

    tensors = (part(param), part(grad), {k: part(v) for k, v in flat_state.items()})
    if cols is None:
        return tensors
    return (*tensors, torch.ones(tensors[0].shape[0], 1, device=param.device))


def _blocked(device: torch.device, strategy) -> bool:
    """Whether the float32 CPU kernel measures ``strategy`` on ``device``."""
    return device.type == "cpu" and strategy.name in _PARTS


def _ranges(numel: int) -> list[tuple[int, int, int]]:
    """``(start, stop, cols)`` of the CPU kernel's calls: whole rows of ``BLOCK`` elements
    (at most ``fused._MAX_CALL_NUMEL`` per call, for the int32 draw counter), then the
    remainder as one row. Two shapes, so two compilations at most: ``(rows, BLOCK)`` and
    ``(1, cols)`` (dynamo specialises a dimension of size 1)."""
    bulk = numel - numel % BLOCK
    step = fused._MAX_CALL_NUMEL - fused._MAX_CALL_NUMEL % BLOCK
    out = [(start, min(start + step, bulk), BLOCK) for start in range(0, bulk, step)]
    if bulk < numel:
        out.append((bulk, numel, numel - bulk))
    return out


def _run(optimizer, compiled, eager, args) -> torch.Tensor:
    if fused.available():
        try:
            return compiled(*args)
        except Exception as error:
            if not fused.is_compile_error(error):
                raise
            fused.mark_unavailable()
            optimizer._warn_fallback(f"torch.compile failed ({type(error).__name__})")
    return eager(*args)
