"""The eager paths: the float32 kernel run op by op by torch (``per_tensor``, ``foreach``),
and the reference path (``reference=True``).

* ``per_tensor`` (``foreach=False``) steps one tensor at a time, a large one in ranges of
  ``EAGER_CHUNK`` elements: each range's float32 temporaries (the loaded weight and
  moments, the update, the unscaled gradient) live only while it is stepped, so a step holds
  at most a few MB beyond the persistent tensors however large the parameter (the memory
  that ``collage memory`` predicts is the memory a step needs).
* ``foreach`` (``foreach=True``) does the same and also concatenates the group's small
  tensors of one step value into one call (:func:`plan_calls`), so that a model's many biases
  and norms do not each pay a dozen small torch calls. Elementwise arithmetic: the results
  are bit for bit ``per_tensor``'s.
* ``reference`` runs :func:`kernels.reference_step` per tensor.

A measured step (``track_updates``) runs per tensor, unchunked, in float64
(:meth:`collage.metrics.UpdateStats.add`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import mcf
from . import draws as keyed
from . import kernels
from .group import (
    Entry,
    GroupStep,
    advance_steps,
    component_slice,
    draw_key_at,
    entries_of,
    prepare_grad,
)

__all__ = ["EAGER_CHUNK", "SMALL_NUMEL", "Call", "plan_calls", "run_calls", "step_per_tensor",
           "step_foreach", "step_reference"]

#: Elements per call of the chunked eager step: a multiple of plus8's block (128); its
#: float32 temporaries (~50 B per element at most) stay around 3 MB, in cache.
EAGER_CHUNK = 1 << 16
#: Tensors below this many elements are concatenated into one call (foreach, compiled).
SMALL_NUMEL = 1 << 14


@dataclass
class Call:
    """One kernel call: elements ``start:stop`` of one entry, or every element of several
    small entries of one step value (concatenated, stepped, copied back)."""

    step: int
    members: list[Entry]
    start: int
    stop: int


def plan_calls(group: GroupStep, entries: list[Entry], max_numel: int, batch: bool
               ) -> list[Call]:
    """The calls that step ``entries``: a tensor of at least ``SMALL_NUMEL`` elements (every
    tensor when not ``batch``, or when the strategy's draws or per-block components are
    keyed per tensor) in calls of at most ``max_numel`` elements; the small ones concatenated
    per (device, dtypes, step), at most ``max_numel`` elements per call: a group may hold
    tensors of several devices (torch.optim groups by device too), and one concatenation
    cannot."""
    strategy, rule = group.strategy, group.rule
    batch = batch and not strategy.draws and strategy.elementwise(rule)
    calls: list[Call] = []
    buckets: dict[tuple, list[Entry]] = {}
    for entry in entries:
        if entry.numel == 0:
            continue
        if batch and entry.numel < SMALL_NUMEL:
            buckets.setdefault((entry.param.device, entry.param.dtype, entry.grad.dtype,
                                entry.step), []).append(entry)
            continue
        for start in range(0, entry.numel, max_numel):
            calls.append(Call(entry.step, [entry], start, min(start + max_numel, entry.numel)))
    for (*_, step), bucket in buckets.items():
        chunk: list[Entry] = []
        total = 0
        for entry in bucket:
            if total + entry.numel > max_numel and chunk:
                calls.append(Call(step, chunk, 0, total))
                chunk, total = [], 0
            chunk.append(entry)
            total += entry.numel
        calls.append(Call(step, chunk, 0, total))
    return calls


#: ``kernel(param, grad, state, step, key)``: one call's flat tensors stepped in place
Kernel = Callable[[torch.Tensor, torch.Tensor, dict, int, "torch.Tensor | None"], None]


def run_calls(group: GroupStep, calls: list[Call], kernel: Kernel) -> None:
    """Run ``kernel`` on each call's flat views (a batch concatenated, then copied back)."""
    for call in calls:
        if len(call.members) == 1:
            entry = call.members[0]
            start, stop = call.start, call.stop
            tensors = component_slice(group.strategy, group.rule, entry.tensors, start, stop)
            kernel(entry.param.view(-1)[start:stop], entry.grad.view(-1)[start:stop], tensors,
                   call.step, draw_key_at(group, entry, start))
            continue
        members = call.members
        flat_param = torch.cat([e.param.view(-1) for e in members])
        flat_grad = torch.cat([e.grad.view(-1) for e in members])
        flat_state = {k: torch.cat([e.tensors[k].view(-1) for e in members])
                      for k in members[0].tensors}
        kernel(flat_param, flat_grad, flat_state, call.step, None)
        sizes = [e.numel for e in members]
        torch._foreach_copy_([e.param.view(-1) for e in members], flat_param.split(sizes))
        for k, flat in flat_state.items():
            torch._foreach_copy_([e.tensors[k].view(-1) for e in members], flat.split(sizes))


def eager_kernel(group: GroupStep) -> Kernel:
    """The float32 kernel run eagerly, coefficients as Python numbers."""
    coeffs: dict[int, dict] = {}

    def kernel(param, grad, state, step, key) -> None:
        if step not in coeffs:
            coeffs[step] = group.coefficients(step)
        g = prepare_grad(grad, group.grad_scale, group.maximize)
        kernels.fast_step(group.rule, group.strategy, param, g, state, coeffs[step], key)

    return kernel


def step_per_tensor(group: GroupStep, entries: list[Entry] | None = None) -> None:
    """``foreach=False``: one tensor at a time (a large one in ranges)."""
    _step_eager(group, entries, batch=False)


def step_foreach(group: GroupStep, entries: list[Entry] | None = None) -> None:
    """``foreach=True``: as :func:`step_per_tensor`, small tensors concatenated."""
    _step_eager(group, entries, batch=True)


def _step_eager(group: GroupStep, entries: list[Entry] | None, batch: bool) -> None:
    entries = entries_of(group) if entries is None else entries
    if group.stats is not None:
        for entry in entries:
            step_one(group, entry, reference=False)
        return
    flat, other = _split_contiguous(entries)
    advance_steps(flat)
    run_calls(group, plan_calls(group, flat, EAGER_CHUNK, batch), eager_kernel(group))
    for entry in other:
        step_one(group, entry, reference=False)


def step_reference(group: GroupStep, entries: list[Entry] | None = None) -> None:
    """``reference=True``: the op-by-op kernel, one tensor at a time."""
    for entry in entries_of(group) if entries is None else entries:
        step_one(group, entry, reference=True)


def _split_contiguous(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(entries a flat kernel can step, the rest): contiguous tensors on one device whose
    elements are one flat range of the whole tensor."""
    flat, other = [], []
    for entry in entries:
        usable = entry.offset is not None and entry.contiguous_on(entry.param.device)
        (flat if usable else other).append(entry)
    return flat, other


def step_one(group: GroupStep, entry: Entry, reference: bool) -> None:
    """One tensor whole, on its own: advances its counter, measures it if asked."""
    rule, strategy, stats = group.rule, group.strategy, group.stats
    state = entry.state
    state["step"] += 1
    entry.step = int(state["step"].item())
    coeffs = (group.rule.reference_coefficients(group.hyper, entry.step) if reference
              else group.coefficients(entry.step))
    param, tensors = entry.param, entry.tensors
    key = _whole_draws(group, entry)
    before = visible_before = None
    if stats is not None:
        before = kernels.represented_value(strategy, param, tensors)
        visible_before = param.detach().clone()
    _lay_states_as_weight(entry)
    if reference:
        grad = _reference_grad(_laid_out_as(param, entry.grad), group,
                               strategy.state_dtype(param.dtype))
        intended = kernels.reference_step(rule, strategy, param, grad, tensors, coeffs, key,
                                          stats is not None)
    else:
        grad = prepare_grad(entry.grad, group.grad_scale, group.maximize)
        intended = kernels.fast_step(rule, strategy, param, grad, tensors, coeffs, key,
                                     stats is not None)
    if stats is not None:
        after = kernels.represented_value(strategy, param, tensors)
        stats.add(entry.item.stat_keys, intended, before, after,
                  visible_before=visible_before, visible_after=param,
                  compensation=strategy.compensation_of(tensors))


def _whole_draws(group: GroupStep, entry: Entry) -> torch.Tensor | None:
    """The draws of one whole local tensor: its key where it is one flat range of the
    parameter, else its uniforms cut from the whole tensor's (any shard layout)."""
    if not group.strategy.draws or entry.offset is not None:
        return draw_key_at(group, entry, 0)
    whole = keyed.draw_key(group.seed, entry.item.position, entry.step, 0,
                           entry.param.device)
    return keyed.local_uniform(entry.item.param, entry.param, whole)


def _laid_out_as(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``param``'s strides (a copy where they differ). The reference rule's
    bf16 operations round differently in torch's vectorized and scalar loops (``add_``
    with ``alpha`` is one fused rounding in the first, two in the second), and torch takes the
    scalar loop where its operands' layouts differ: a channels_last gradient of a contiguous
    weight would give other moments than the same values laid out as the weight."""
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param, dtype=grad.dtype).copy_(grad)


def _lay_states_as_weight(entry: Entry) -> None:
    """The state's components given the weight's strides where they differ (copies, kept in
    the state: done once), for the reason of :func:`_laid_out_as`: a weight laid out anew
    (``model.to(memory_format=torch.channels_last)`` after the optimizer was made, which
    ``edits.WriteLog`` does not take for an edit) would otherwise be stepped by torch's
    scalar loop against its contiguous states, and round some fused operations otherwise
    than the run that had the layout from the start. Every such entry comes here: the
    flat paths (foreach, native, Triton) take only contiguous ones. Plain tensors only (a
    sharded state is its shards' layout)."""
    param, state = entry.param, entry.state
    for key, tensor in entry.tensors.items():
        if (tensor.shape == param.shape and tensor.stride() != param.stride()
                and state.get(key) is tensor):
            laid = torch.empty_like(param, dtype=tensor.dtype).copy_(tensor)
            state[key] = entry.tensors[key] = laid


def _reference_grad(grad: torch.Tensor, group: GroupStep, dtype: torch.dtype) -> torch.Tensor:
    """The gradient in the dtype the reference rule computes in. Unscaled (GradScaler) and
    negated (``maximize``) in float64 and rounded once: unscaling in fp16 first would flush
    small unscaled gradients to zero."""
    if dtype == torch.float32:
        return prepare_grad(grad, group.grad_scale, group.maximize)
    if group.grad_scale is None and not group.maximize:
        return grad.to(dtype)  # fp16 gradients of fp16 weights: rounded once into bf16
    wide = grad.double()
    if group.grad_scale is not None:
        wide = wide / group.grad_scale.double().to(grad.device)
    if group.maximize:
        wide = -wide
    return mcf.round_to(wide, dtype)
