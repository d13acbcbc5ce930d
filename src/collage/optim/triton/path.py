"""The Triton path of the dispatch: which groups the Triton kernels can step, and the
runner that steps them (``dispatch.choose`` picks ``"triton"``; ``docs/gpu.md``).

The kernels cover AdamW, SGD and Lion under every strategy with a landing in
``layout.LANDINGS`` (by ``Strategy.native_code``; plus8's block-scaled 8-bit moments and
feedback's error feedback are not among them: their groups take the compiled path), weights
of the strategy's dtypes whose components are float32, bf16, fp16 or int16 (stochastic
rounding: bf16 weights). They run on CUDA tensors, and on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``: slow, for tests). Measured steps (``track_updates``) run the compiled kernels.

A step with the non-finite check's verdict left on the device (``group.found_nonfinite``:
the default) and a capturable step (``capturable=True``) keep the step counters on the
device, advance them by one (or by ``1 - verdict``), compute the coefficients there and read
the learning rate from a device tensor when it is one:
nothing in it waits for the device, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch

from .. import eager
from ..group import Entry, GroupStep, advance_steps
from . import launch as launches
from . import layout
from .plan import Bucket, TritonPlan

__all__ = ["available", "unavailable", "fits", "step_triton", "planned", "check_planned",
           "step_planned"]

_CACHE = "triton"  # the group cache's key of this path's launches
_PLAN = "triton_plan"  # ... and of its plan
_MAX_LAUNCHES = 16  # launches kept per group (buckets of steps and dtypes)


def available(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device`` in this process."""
    return _device_reason(device) is None


def _device_reason(device: torch.device) -> str | None:
    if launches.triton is None:
        return "Triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if launches.interpreting():
            return None
        return "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
    return f"the Triton kernels do not run on {device.type} tensors"


def unavailable(group: GroupStep, device: torch.device) -> str | None:
    """Why the Triton kernels cannot step ``group`` on ``device``, or None where they can."""
    reason = _device_reason(device)
    if reason is not None:
        return reason
    rule, strategy = group.rule, group.strategy
    if rule.name not in layout.RULE_CODES:
        return f"no Triton kernel computes {rule.title}"
    if strategy.native_code not in layout.LANDINGS:
        return f"no Triton kernel lands strategy {strategy.name!r}"
    if group.stats is not None:
        return "measured steps (track_updates) run the compiled kernels"
    return None


def fits(group: GroupStep, entry: Entry, device: torch.device) -> bool:
    """Whether the kernels take ``entry``: one flat range of its parameter, every tensor
    contiguous on ``device``, of dtypes the kernels read (stochastic rounding: bf16)."""
    if entry.offset is None or not _reads(group, entry.param.dtype):
        return False
    if entry.grad.dtype != entry.param.dtype:  # the kernels read the gradient in the
        return False  # weight's dtype: a float32 sum (grad_accumulation="pair") is not
    return entry.contiguous_on(device)


def _reads(group: GroupStep, dtype: torch.dtype) -> bool:
    """Whether the kernels read the strategy's components for ``dtype`` weights (kept in
    the group's cache: asked once per tensor per step)."""
    known = group.cache.setdefault(_CACHE + "_dtypes", {})
    if dtype not in known:
        strategy = group.strategy
        known[dtype] = (dtype in strategy.weight_dtypes
                        and (not strategy.draws or dtype == torch.bfloat16)
                        and all(c.dtype in layout.KINDS
                                for c in strategy.components(group.rule, dtype)))
    return known[dtype]


def step_triton(group: GroupStep, entries: list[Entry]) -> None:
    """Step ``entries``: those the kernels take in one launch per weight dtype (per step
    value, and aligned or not), the rest with the eager kernel, one by one (same
    arithmetic). Capturable, or with the non-finite verdict on the device
    (``group.found_nonfinite``), the step counters and coefficients live on the device."""
    device = entries[0].param.device
    fit, rest = [], []
    for entry in entries:
        (fit if fits(group, entry, device) else rest).append(entry)
    found = group.found_nonfinite
    if group.hyper.get("capturable", False):
        if rest:
            raise ValueError(
                f"capturable=True: parameter {rest[0].item.name!r} cannot be stepped by the "
                f"Triton kernels (not contiguous, not on {device}, a shard that is not one "
                "flat range, or a dtype they do not read); the eager kernel it would need "
                "synchronises with the device")
        _step_on_device(group, fit, found, whole_group=True)
    elif found is not None:
        _step_on_device(group, fit, found, whole_group=not rest)
        # the eager kernel cannot read the verdict on the device: the host reads it (rare
        # layouts only: a view that is not contiguous, a shard that is not one flat range)
        if rest and bool(found.item()):
            return
    else:
        _step(group, fit, whole_group=not rest)
    for entry in rest:
        eager.step_one(group, entry, reference=False)


def _launch_of(group: GroupStep, key: tuple, bucket: list[Entry],
               capturable: bool) -> launches.Launch:
    """The bucket's launch, kept in the group's cache while its tensors stay where they
    are; its gradients' addresses refreshed."""
    cache = group.cache.setdefault(_CACHE, {})
    signature = launches.signature_of(bucket, capturable)
    launch = cache.get(key)
    if launch is None or launch.signature != signature:
        if len(cache) >= _MAX_LAUNCHES:
            cache.clear()
        launch = cache[key] = launches.build(group, bucket, capturable, signature)
    else:
        launches.refresh_grads(launch, [e.grad.data_ptr() for e in bucket])
    return launch


def _aligned(entry: Entry) -> bool:
    """Whether every tensor of ``entry`` starts on 16 bytes (the caching allocator's
    blocks do; a view may not): such entries share launches whose loads are vectors, the
    others get their own (``kernels.columns._pointer``'s ``ALIGNED``)."""
    tensors = (entry.param, entry.grad, *entry.tensors.values())
    return launches.on_16_bytes(t.data_ptr() for t in tensors)


def _interpreted(device: torch.device) -> bool:
    """CPU tensors run in Triton's interpreter, whose ``tl.fma`` rounds twice and whose
    bf16 conversion does not round to nearest: the kernels compute both exactly in
    software there (``launch.variant_flags``)."""
    return device.type == "cpu"


def _step(group: GroupStep, entries: list[Entry], whole_group: bool) -> None:
    """Counters on the host: one launch per (weight dtype, alignment, step value), the
    coefficients as arguments; then, where the whole group was stepped so, a plan for the
    next steps (``plan.py``)."""
    group.cache.pop(_PLAN, None)
    if not entries:
        return
    for entry in entries:
        counter = entry.state["step"]
        if counter.device.type != "cpu":
            # loaded onto the device (load_state_dict puts states there): back to the
            # host, read once, so that no later step waits for the device to read it
            entry.state["step"] = counter.cpu()
    advance_steps(entries)
    device = entries[0].param.device
    positions: dict[tuple, list[int]] = {}
    for index, entry in enumerate(entries):
        key = (entry.param.dtype, _aligned(entry), entry.step)
        positions.setdefault(key, []).append(index)
    scale = launches.grad_scale(group, device)
    done: list[Bucket] = []
    for (dtype, aligned, step), members in positions.items():
        bucket = [entries[i] for i in members]
        coefficients = group.coefficients(step)
        key = (dtype, aligned, tuple(e.item.position for e in bucket))
        launch = _launch_of(group, key, bucket, capturable=False)
        flags = launches.kernel_flags(group, dtype, launches.decays(coefficients), False,
                                      _interpreted(device))
        launches.launch(launch, flags, launches.step_arguments(group.rule, coefficients),
                        step, None, scale)
        done.append((launch, members, dtype))
    if whole_group:
        plan = TritonPlan.build(group, entries, done)
        if plan is not None:
            group.cache[_PLAN] = plan


def planned(group: GroupStep) -> list[int] | None:
    """The gradients' addresses for the plan the group's last Triton step left, if it
    still describes the group (``TritonPlan.ready``: also its counters' place, the host's
    or the device's); else None, the plan dropped."""
    plan = group.cache.get(_PLAN)
    grads = None if plan is None else plan.ready(group)
    if grads is None:
        group.cache.pop(_PLAN, None)
    return grads


def check_planned(group: GroupStep, grads: list[int], found: torch.Tensor) -> None:
    """Raise the device verdict ``found`` where a gradient at :func:`planned`'s addresses
    holds inf or nan (``TritonPlan.check``)."""
    group.cache[_PLAN].check(grads, found)


def step_planned(group: GroupStep, grads: list[int]) -> bool:
    """Step with the plan and :func:`planned`'s addresses (always done: True)."""
    group.cache[_PLAN].step(group, grads)
    return True


def _step_on_device(group: GroupStep, entries: list[Entry], found: torch.Tensor | None,
                    whole_group: bool) -> None:
    """Counters on the device: one launch per weight dtype, each row's coefficients
    computed there from its counter. ``found``: the device's non-finite verdict; where it
    is set the counters stay (advanced by ``1 - found``) and the kernels write nothing."""
    group.cache.pop(_PLAN, None)
    if not entries:
        return
    device = entries[0].param.device
    positions: dict[tuple, list[int]] = {}
    for index, entry in enumerate(entries):
        positions.setdefault((entry.param.dtype, _aligned(entry)), []).append(index)
    # the counters in bucket order: each bucket's rows are a slice of one vector
    counters = launches.gather_counters([entries[i] for members in positions.values()
                                for i in members], device)
    launches.advance_counters(counters, found)
    coefficients = launches.device_coefficients(group, counters)
    scale = launches.grad_scale(group, device)
    done: list[Bucket] = []
    start = 0
    for (dtype, aligned), members in positions.items():
        bucket = [entries[i] for i in members]
        key = (dtype, aligned, tuple(e.item.position for e in bucket), "capturable")
        launch = _launch_of(group, key, bucket, capturable=True)
        flags = launches.kernel_flags(group, dtype, launches.capturable_decays(group), True,
                                      _interpreted(device), skippable=found is not None)
        launches.launch(launch, flags, [0.0] * layout.NCOEF, 0,
                        coefficients[start:start + len(members)], scale, found)
        start += len(members)
        done.append((launch, members, dtype))
    if whole_group:
        plan = TritonPlan.build(group, entries, done, on_device=True)
        if plan is not None:
            group.cache[_PLAN] = plan
