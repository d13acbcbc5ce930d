"""Measured steps on the fused path: the step and its lost-update sums in one compiled call.

A measured step needs, per tensor, the represented value before and after, the visible
weight before and after, and the intended update. Materialising those in float64 costs
about 40 bytes per parameter of extra traffic; here they live only in registers: the
compiled kernel reads the components once, performs the step, and reduces
``collage.metrics.update_sums`` (11 float64 sums) in the same pass. Each parameter gets its
own call (no batching of small tensors) so that per-parameter keys stay exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..metrics import update_sums
from . import fused, kernels

__all__ = ["step_group_tracked"]


def _body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    stochastic = strategy.name == "stochastic"

    def step(param, grad, state, packed, static, scale, seeds):
        coeffs, g = fused.kernel_inputs(grad, packed, static, scale, scaled, maximize)
        before = kernels.represented_value(strategy, param, state)
        visible_before = param.double()
        draws = fused.counter_uniform(param.numel(), seeds) if stochastic else None
        intended = kernels.fast_step(rule, strategy, param, g, state, coeffs, draws, True)
        after = kernels.represented_value(strategy, param, state)
        return update_sums(intended, after - before, param.double() - visible_before,
                           kernels.compensation_of(strategy, state))

    return step


_kernels: dict[tuple, tuple[Callable, Callable]] = {}


def _kernel(rule, strategy, scaled: bool, maximize: bool) -> tuple[Callable, Callable]:
    key = (rule.name, strategy.name, scaled, maximize)
    if key not in _kernels:
        body = _body(rule, strategy, scaled, maximize)
        name = f"collage_{rule.name}_{strategy.name}_measured" + ("_scaled" if scaled else "") \
            + ("_max" if maximize else "")
        _kernels[key] = (fused._compile(body, name), body)
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
    compiled, eager = _kernel(rule, strategy, grad_scale is not None,
                              bool(group.get("maximize", False)))
    scale = grad_scale.to(device) if grad_scale is not None else None
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
        packed, static = fused._pack(rule, rule.coefficients(group, int(state["step"].item())),
                                     device)
        flat = {k: v.view(-1) for k, v in tensors.items()}
        offset = fused._flat_offset(param, local_param)
        if strategy.name == "stochastic" and offset is None:  # shard not one flat range
            state["step"] -= 1
            optimizer._step_param(index, group, strategy, name, param, grad, grad_scale, stats)
            continue
        seeds = None
        if strategy.name == "stochastic":  # the same draws as an unmeasured fused step
            seeds = fused.stochastic_seeds(optimizer, param, int(state["step"].item()),
                                           offset, device)
        args = (local_param.view(-1), local_grad.view(-1), flat, packed, static, scale, seeds)
        sums = _run(optimizer, compiled, eager, args)
        stats.add_sums(optimizer._stat_keys(index, group, name), sums)
    return True


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
