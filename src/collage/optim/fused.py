"""The fused path: the float32-register kernel compiled by torch.compile, one pass per tensor.

On CPU, AdamW groups that ``native.covers`` run hand-written C kernels instead (see
``native.py``: the same arithmetic as the foreach path, one C call per group); everything
below describes the inductor kernels, which serve every other group.

Inductor turns each kernel into one loop over memory (C++/OpenMP on CPU, Triton on CUDA) that
reads every stored component once and writes it once: the weight (and its ``lo`` or
compensation), the gradient *in its own dtype* (converted, unscaled and negated in
registers), each optimizer state. Shapes are dynamic and per-step coefficients arrive as 0-d
tensors, so one compilation per kernel variant serves every parameter size and every learning
rate; a learning-rate schedule never recompiles.

:func:`step_group` runs one parameter group:

* step counters advance with one ``_foreach_add_``; coefficients are computed once per
  distinct step value (not once per parameter);
* tensors of at least ``SMALL_NUMEL`` elements get one kernel call each; smaller ones are
  concatenated per (dtype, step) into flat buffers, stepped by one call and copied back, so
  that a model's many biases and norms do not each pay a call's fixed cost;
* ``stochastic`` draws its uniforms *inside* the kernel from a counter-based hash
  (:func:`counter_uniform`) keyed like the other paths by (seed, parameter position, step)
  and indexed by the element's position in the whole tensor: no float32 draw tensor is
  written and read back, and the draws are sharding- and resume-invariant. It is a different
  stream from the foreach path's ``torch.rand``; given the same draws the two paths agree
  bit for bit (``tests/bench`` checks this). Stochastic tensors are not batched (their
  draws are keyed per tensor).

Compiled kernels live in the process; their generated code is cached on disk by inductor's
FX graph cache (default on; ``TORCHINDUCTOR_CACHE_DIR`` moves it), so a second process pays
the dynamo trace but not the C++ compile. Where compilation cannot work (no C++ compiler, no
Triton, an inductor failure) the same Python kernel runs eagerly, with one warning.
"""

from __future__ import annotations

import shutil
import types
from collections.abc import Callable

import torch

from . import kernels, native
from .native_plan import NativePlan

__all__ = [
    "SMALL_NUMEL",
    "compiled_step",
    "counter_uniform",
    "is_compile_error",
    "mark_unavailable",
    "step_group",
    "stochastic_seeds",
]

# Tensors below this many elements are batched (concatenated) into one kernel call.
SMALL_NUMEL = 1 << 14
# Most elements one call handles: the in-kernel counter is an int32.
_MAX_CALL_NUMEL = 1 << 30

_compiled: dict[tuple, Callable] = {}
_unavailable = False
_compiler_checked = False


def _compiler_present() -> bool:
    try:
        from torch._inductor import config
    except Exception:  # pragma: no cover - stripped builds
        return False
    compiler = getattr(config.cpp, "cxx", (None, "g++"))
    names = compiler if isinstance(compiler, (tuple, list)) else (compiler,)
    return any(name and shutil.which(name) for name in names)


def available() -> bool:
    """Whether compiled kernels can be built in this process (a C++ compiler or Triton)."""
    global _compiler_checked
    if _unavailable or not hasattr(torch, "compile"):
        return False
    if not _compiler_checked:
        _compiler_checked = True
        if not _compiler_present():
            mark_unavailable()
            return False
    return True


def mark_unavailable() -> None:
    """Stop trying to compile in this process (after a failure)."""
    global _unavailable
    _unavailable = True


def is_compile_error(error: BaseException) -> bool:
    """Errors raised by dynamo/inductor while building a kernel (not by our numerics)."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _compile(fn: Callable, name: str, options: dict | None = None) -> Callable:
    """torch.compile ``fn`` under its own code object (``options``: more inductor options).

    Dynamo keeps compiled graphs (and counts recompilations against its limit) per code
    object; closures of one ``def`` share theirs. Renaming the code gives every kernel
    variant its own cache, so eight strategies x three rules never evict each other.
    """
    code = fn.__code__.replace(co_name=name)
    unique = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    # emulate_precision_casts: without it inductor may skip a bf16 round trip (store, then
    # reload as float32) and keep float32 bits, which would make every residual zero.
    return torch.compile(unique, dynamic=True,
                         options={"emulate_precision_casts": True, **(options or {})})


# ---------------------------------------------------------------------------------------
# counter-based uniforms for stochastic rounding
# ---------------------------------------------------------------------------------------


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons) on int32 with wrapping multiplies;
    ``& mask`` after each shift makes the arithmetic shifts logical."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))
    return x ^ ((x >> 16) & 0xFFFF)


def counter_uniform(n: int, seeds: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """``n`` float32 uniforms in [0, 1) on a 2**-24 grid (like ``torch.rand``) for element
    indices ``seeds[2] + 0..n-1``, keyed by the int32 ``seeds[0]``, ``seeds[1]``: two rounds
    of a 32-bit hash. A nonzero int32 ``salt`` gives an independent stream from the same
    seeds (``plus8`` rounds two states per element).

    Pure function of (index, seeds): eager and compiled give the same bits, and inside a
    compiled kernel nothing is stored (the hash is computed in registers).
    """
    index = torch.arange(n, dtype=torch.int32, device=seeds.device) + seeds[2]
    h = _mix32(index ^ (seeds[0] ^ salt) if salt else index ^ seeds[0])
    h = _mix32(h ^ seeds[1])
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (2.0**-24)


def stochastic_seeds(optimizer, param, step: int, first_index: int,
                     device: torch.device) -> torch.Tensor:
    """The int32 ``[key0, key1, first element index]`` of ``param``'s draws at ``step``.

    Keyed like the other paths (``optimizer.seed``, the parameter's position in the
    optimizer, the step) and indexed by the element's position in the *whole* tensor, so the
    draws depend neither on sharding nor on generator state: DDP ranks agree, an FSDP2 shard
    draws what one process draws for those elements, and a resume needs only ``step``.
    """
    words = [*stochastic_key(optimizer, param, step), first_index]
    return torch.tensor(words, dtype=torch.int32, device=device)


def stochastic_key(optimizer, param, step: int) -> tuple[int, int]:
    """The two int32 key words of :func:`stochastic_seeds` as Python ints (native plans
    compute the same in C: ``collage_stochastic_keys``)."""
    from .base import _mix

    key = _mix(optimizer.seed, optimizer._parameter_positions()[id(param)], step)
    return (key & 0xFFFFFFFF) - (1 << 31), (key >> 32) & 0x7FFFFFFF


def _flat_offset(param, local) -> int | None:
    """Index of ``local``'s first element in the flattened whole ``param``, when the local
    tensor is one contiguous range of it (plain tensors; DTensors sharded on dim 0 only)."""
    if not hasattr(param, "device_mesh"):
        return 0
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements)
    except Exception:  # pragma: no cover - other DTensor layouts
        return None
    if tuple(shape[1:]) != tuple(param.shape[1:]):
        return None  # sharded on an inner dimension: not one flat range
    inner = 1
    for size in param.shape[1:]:
        inner *= size
    return int(offset[0]) * inner if len(offset) else 0


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


def kernel_inputs(grad, packed, static, scale, scaled: bool, maximize: bool):
    """(coefficients, float32 gradient) inside a kernel: the per-step coefficients arrive
    as one float64 vector (unpacked into 0-d views in the graph), the gradient in its own
    dtype (converted, unscaled and negated in registers)."""
    coeffs = dict(static)
    for i, key in enumerate(packed[0]):
        coeffs[key] = packed[1][i]
    g = grad.float()
    if scaled:
        g = g / scale
    if maximize:
        g = -g
    return coeffs, g


def _group_kernel_body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    """The Python kernel of one variant: gradient in its own dtype in, components updated."""
    stochastic = strategy.name == "stochastic"

    def step(param, grad, state, packed, static, scale, seeds):
        coeffs, g = kernel_inputs(grad, packed, static, scale, scaled, maximize)
        # plus8 draws its two streams inside fast_step from the seeds themselves
        draws = counter_uniform(param.numel(), seeds) if stochastic else seeds
        kernels.fast_step(rule, strategy, param, g, state, coeffs, draws, False)

    return step


def _group_kernel(rule, strategy, scaled: bool, maximize: bool) -> tuple[Callable, Callable]:
    """(compiled, eager) kernels of a variant; compiled once per process."""
    key = ("group", rule.name, strategy.name, scaled, maximize)
    body = _group_kernel_body(rule, strategy, scaled, maximize)
    if key not in _compiled:
        name = f"collage_{rule.name}_{strategy.name}" + ("_scaled" if scaled else "") + (
            "_max" if maximize else "")
        _compiled[key] = _compile(body, name)
    return _compiled[key], body


def compiled_step(rule, strategy):
    """The compiled per-parameter kernel ``(param, grad32, state, coeffs, draws, want)`` for
    (rule, strategy), or None where compilation is unavailable. Used for the steps that
    measure lost updates (``track_updates``), which need the intended update back."""
    if not available():
        return None
    key = ("param", rule.name, strategy.name)
    if key not in _compiled:
        def step(param, grad, state, coeffs, generator, want_intended):
            return kernels.fast_step(rule, strategy, param, grad, state, coeffs, generator,
                                     want_intended)

        _compiled[key] = _compile(step, f"collage_{rule.name}_{strategy.name}_tracked")
    return _compiled[key]


# ---------------------------------------------------------------------------------------
# one parameter group
# ---------------------------------------------------------------------------------------


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Entry:
    __slots__ = ("name", "whole", "param", "grad", "state", "tensors", "numel", "step",
                 "offset", "native")

    def __init__(self, name, whole, param, grad, state, tensors, offset, native_row=None):
        self.name, self.whole, self.offset = name, whole, offset
        self.param, self.grad, self.state = param, grad, state
        self.tensors = tensors  # state components (no "step"), local tensors
        self.numel = param.numel()
        self.native = native_row  # native.row_tensors(...) on the native path


def step_group(optimizer, index: int, group: dict, strategy, items, grad_scale,
               stats=None) -> bool:
    """Step every parameter of ``group`` on the fused path; False if the group is not on it.

    ``items`` are ``(name, param, grad)`` with gradients present. Returns False (and changes
    nothing) when the group's path is not fused or compiled kernels are unavailable; the
    optimizer then takes its per-parameter path, which warns and runs eagerly.

    On CPU, groups the native kernels cover (``native.covers``) run them (one C call per
    step value and gradient dtype) instead of inductor's; such groups are on the fused path
    by default (``fused=None``).

    ``stats`` (a measured step, ``collage.metrics.UpdateStats``): only native groups are
    stepped here, by the measured native kernel, which adds each tensor's sums under
    ``optimizer._stat_keys``; other groups return False (``tracked.py`` measures them).
    """
    if not items:
        return stats is None
    plans = optimizer.__dict__.setdefault("_native_plans", {})
    plan = plans.pop(index, None)
    if plan is not None and stats is None and plan.step(optimizer, group, items, grad_scale):
        plans[index] = plan  # the last step's table, checked (native_plan.py)
        optimizer._fused_backend = "native"
        return True
    device = _local(items[0][1]).device
    rule = optimizer.rule
    use_native = (device.type == "cpu" and group["foreach"] is None
                  and group["fused"] is not False) and native.covers(
        rule, strategy, [_local(p) for _, p, _ in items], [_local(g) for _, _, g in items])
    if stats is not None and not use_native:
        return False
    if optimizer._path(group, device, native=use_native) != "fused" or not (
            use_native or available()):
        return False
    scaled = grad_scale is not None
    maximize = bool(group.get("maximize", False))
    stochastic = strategy.name == "stochastic"
    # keyed draws (stochastic, plus8): one call per tensor, never batched; plus8's block
    # scales also need the whole tensor in one call (it is never split)
    keyed = stochastic or strategy.eight_bit
    entries: list[_Entry] = []
    for name, param, grad in items:
        state = optimizer.state[param]
        if not state:
            kernels.init_state(rule, strategy, param, state)
        local_param, local_grad = _local(param), _local(grad)
        tensors = {k: _local(v) for k, v in state.items() if k != "step"}
        offset = _flat_offset(param, local_param) if keyed else 0
        usable = (local_param.device == device and local_grad.device == device
                  and local_param.is_contiguous() and local_grad.is_contiguous()
                  and all(t.is_contiguous() and t.device == device for t in tensors.values())
                  and offset is not None)
        native_row = None
        if usable and use_native:
            native_row = native.row_tensors(strategy.name, local_param, local_grad, tensors,
                                            checked=True)
            usable = native_row is not None
        if not usable:  # rare layouts: the per-parameter path (it advances its own step)
            optimizer._step_param(index, group, strategy, name, param, grad, grad_scale, stats)
            continue
        entries.append(_Entry(name, param, local_param, local_grad, state, tensors, offset,
                              native_row))
    if not entries:
        return True

    steps = [entry.state["step"] for entry in entries]
    torch._foreach_add_(steps, 1.0)
    values = torch.stack(steps).tolist() if len(steps) > 1 else [steps[0].item()]
    if use_native:
        for entry, value in zip(entries, values):
            entry.step = int(value)
        _step_native(optimizer, index, group, strategy, entries, grad_scale, maximize,
                     stats)
        optimizer._fused_backend = "native"
        if stats is None and len(entries) == len(items):
            plan = NativePlan.build(optimizer, group, strategy, entries)
            if plan is not None:
                plans[index] = plan
        return True
    optimizer._fused_backend = "inductor"
    coeffs_by_step: dict[int, tuple] = {}
    for entry, value in zip(entries, values):
        entry.step = int(value)
        if entry.step not in coeffs_by_step:
            coeffs_by_step[entry.step] = _pack(rule, rule.coefficients(group, entry.step),
                                                 device)

    # Jobs: one kernel call each. A large tensor (split every _MAX_CALL_NUMEL elements), or a
    # bucket of small tensors of one (dtype, step) that is concatenated, stepped, copied back.
    jobs: list[tuple[int, list[_Entry], int, int]] = []  # (step, members, start, stop)
    buckets: dict[tuple, list[_Entry]] = {}
    for entry in entries:
        if entry.numel == 0:
            continue
        if strategy.eight_bit:
            jobs.append((entry.step, [entry], 0, entry.numel))
        elif entry.numel >= SMALL_NUMEL or stochastic:  # stochastic: draws keyed per tensor
            for start in range(0, entry.numel, _MAX_CALL_NUMEL):
                jobs.append((entry.step, [entry], start, start + _MAX_CALL_NUMEL))
        else:
            buckets.setdefault((entry.param.dtype, entry.step), []).append(entry)
    for (_, step), bucket in buckets.items():
        chunk: list[_Entry] = []
        total = 0
        for entry in bucket:
            if total + entry.numel > _MAX_CALL_NUMEL and chunk:
                jobs.append((step, chunk, 0, total))
                chunk, total = [], 0
            chunk.append(entry)
            total += entry.numel
        jobs.append((step, chunk, 0, total))

    compiled, eager = _group_kernel(rule, strategy, scaled, maximize)
    scale = grad_scale.to(device) if scaled else None
    for step, members, start, stop in jobs:
        packed, static = coeffs_by_step[step]
        job_seeds = None
        if keyed:
            entry = members[0]
            job_seeds = stochastic_seeds(optimizer, entry.whole, step, entry.offset + start,
                                         device)
        if len(members) == 1:
            entry = members[0]
            args = (entry.param.view(-1)[start:stop], entry.grad.view(-1)[start:stop],
                    {k: v.view(-1)[start:stop] for k, v in entry.tensors.items()}, packed,
                    static, scale, job_seeds)
            compiled = _run(optimizer, compiled, eager, args)
            continue
        flat_param = torch.cat([e.param.view(-1) for e in members])
        flat_grad = torch.cat([e.grad.view(-1) for e in members])
        flat_state = {k: torch.cat([e.tensors[k].view(-1) for e in members])
                      for k in members[0].tensors}
        compiled = _run(optimizer, compiled, eager,
                        (flat_param, flat_grad, flat_state, packed, static, scale, job_seeds))
        sizes = [e.numel for e in members]
        torch._foreach_copy_([e.param.view(-1) for e in members], flat_param.split(sizes))
        for k, flat in flat_state.items():
            torch._foreach_copy_([e.tensors[k].view(-1) for e in members], flat.split(sizes))
    return True


def _step_native(optimizer, index: int, group: dict, strategy, entries: list[_Entry],
                 grad_scale, maximize: bool, stats=None) -> None:
    """The native CPU kernels: one call per (step value, gradient dtype), all tensors; with
    ``stats``, the measured kernel, whose per-tensor sums (a float64 host array: nothing to
    synchronise) are added to the tensors' keys, once per distinct key."""
    stochastic = strategy.name == "stochastic"
    scale = None if grad_scale is None else float(grad_scale)
    jobs: dict[tuple, list[tuple]] = {}
    owners: dict[tuple, list[int]] = {}
    for position, entry in enumerate(entries):
        if entry.numel == 0:
            continue
        keys = stochastic_key(optimizer, entry.whole, entry.step) if stochastic else (0, 0)
        job = (entry.step, entry.grad.dtype)
        jobs.setdefault(job, []).append((entry.native, entry.offset, *keys))
        owners.setdefault(job, []).append(position)
    sums = None
    if stats is not None:  # one row per entry; an empty tensor adds zeros under its keys
        sums = torch.zeros(len(entries), native._FIELDS, dtype=torch.float64)
    for job, rows in jobs.items():
        out = None
        if sums is not None:  # the usual single job over every entry writes in place
            whole = len(owners[job]) == len(entries)
            out = sums if whole else torch.empty(len(rows), native._FIELDS,
                                                 dtype=torch.float64)
        native.adamw(strategy.name, optimizer.rule.coefficients(group, job[0]), rows,
                     scale=scale, maximize=maximize, sums=out)
        if out is not None and out is not sums:
            sums[owners[job]] = out
    if stats is not None:
        _add_native_sums(optimizer, index, group, entries, sums, stats)


def _add_native_sums(optimizer, index: int, group: dict, entries: list[_Entry],
                     sums: torch.Tensor, stats) -> None:
    """Each entry's row of ``sums`` into its keys (``optimizer._stat_keys``), once per
    distinct key: a key shared by every entry (``""``, the group's) adds one float64 total."""
    by_key: dict[str, list[int]] = {}
    for position, entry in enumerate(entries):
        for key in dict.fromkeys(optimizer._stat_keys(index, group, entry.name)):
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
        stats.add_sums(key, row)


def _pack(rule, coeffs: dict, device: torch.device
          ) -> tuple[tuple[tuple[str, ...], torch.Tensor], dict]:
    """((keys, float64 vector), static): the coefficients that change from step to step in
    one tensor (a new learning rate is new data, never a recompilation), the ones the kernels
    branch on (``rule.static``) as Python values."""
    keys = tuple(k for k in coeffs if k not in rule.static)
    vector = torch.tensor([float(coeffs[k]) for k in keys], dtype=torch.float64, device=device)
    return (keys, vector), {k: coeffs[k] for k in coeffs if k in rule.static}


def _run(optimizer, compiled, eager, args):
    """Run ``compiled`` (or ``eager`` once compilation failed); returns the kernel to use
    for the next call."""
    if compiled is eager:
        eager(*args)
        return eager
    try:
        compiled(*args)
        return compiled
    except Exception as error:
        if not is_compile_error(error):
            raise
        mark_unavailable()
        optimizer._warn_fallback(f"torch.compile failed ({type(error).__name__})")
        eager(*args)  # compilation fails before the kernel runs: nothing was written
        return eager
