"""The compiled path: the float32 kernel compiled by torch.compile (inductor), one pass per
call, and its measured variant.

Inductor turns the kernel into one loop over memory (C++/OpenMP on CPU, Triton on CUDA) that
reads every stored component once and writes it once: the weight (and its ``lo`` or
compensation), the gradient *in its own dtype* (converted, unscaled and negated in
registers), each optimizer state. Shapes are dynamic and per-step coefficients arrive as one
float64 vector, so one compilation per kernel variant serves every parameter size and every
learning rate: a schedule never recompiles. The calls are :func:`eager.plan_calls`'s (large
tensors alone, small ones concatenated); draws are hashed in the kernel (``draws.py``).

Compiled kernels live in the process; their generated code is cached on disk by inductor's
FX graph cache (default on; ``TORCHINDUCTOR_CACHE_DIR`` moves it), so a second process pays
the dynamo trace but not the C++ compile. Where compilation cannot work (no C++ compiler, no
Triton, an inductor failure) the same Python kernel runs eagerly, with one warning.

**Measured steps** (``track_updates``) need, per tensor, the represented value before and
after, the visible weight before and after, and the intended update. Materialising those in
float64 costs about 40 bytes per parameter of extra traffic; here they live in registers:
the compiled kernel reads the components once, performs the step, and reduces the sums of
``collage.metrics.FIELDS`` in the same pass, one tensor per call (exact per-tensor keys).

* On CUDA (any non-CPU device) in float64 throughout (``collage.metrics.update_sums``).
* On CPU inductor converts float32 to float64 one element at a time, which made a measured
  step cost 3-5x an unmeasured one. The CPU kernel therefore stays in float32 per element
  (the intended update in float32, the changes with an exact zero test,
  ``collage.metrics.component_change``) and sees each tensor as ``(rows, BLOCK)`` plus a
  ``(1, rest)`` tail: rows are summed in float32 and only the row sums are added in float64
  (``collage.metrics.update_sums_blocked`` states the error bound). Counts stay exact.
  Strategies with per-block components take the float64 kernel on every device.
"""

from __future__ import annotations

import shutil
import types
from collections.abc import Callable

import torch

from ..metrics import FIELDS, component_change, update_sums, update_sums_blocked
from ..metrics.stats import BLOCK
from . import kernels
from .eager import plan_calls, run_calls
from .group import Entry, GroupStep, advance_steps, draw_key_at

__all__ = ["available", "mark_unavailable", "is_compile_error", "step_compiled",
           "step_compiled_measured", "MAX_CALL_NUMEL"]

#: Most elements one call handles: the in-kernel draw counter is an int32.
MAX_CALL_NUMEL = 1 << 30

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
    variant its own cache, so the strategies x rules never evict each other.
    """
    code = fn.__code__.replace(co_name=name)
    unique = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    # emulate_precision_casts: without it inductor may skip a bf16 round trip (store, then
    # reload as float32) and keep float32 bits, which would make every residual zero.
    return torch.compile(unique, dynamic=True,
                         options={"emulate_precision_casts": True, **(options or {})})


def _variant_name(group: GroupStep, suffix: str = "") -> str:
    return (f"collage_{group.rule.name}_{group.strategy.name}{suffix}"
            + ("_scaled" if group.grad_scale is not None else "")
            + ("_max" if group.maximize else ""))


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


def pack(rule, coeffs: dict, device: torch.device
         ) -> tuple[tuple[tuple[str, ...], torch.Tensor], dict]:
    """((keys, float64 vector), static): the coefficients that change from step to step in
    one tensor (a new learning rate is new data, never a recompilation), the ones the kernels
    branch on (``rule.static``) as Python values."""
    keys = tuple(k for k in coeffs if k not in rule.static)
    vector = torch.tensor([float(coeffs[k]) for k in keys], dtype=torch.float64, device=device)
    return (keys, vector), {k: coeffs[k] for k in coeffs if k in rule.static}


class _Runner:
    """Runs a compiled kernel, or its eager body once compilation failed (one warning)."""

    def __init__(self, group: GroupStep, compiled: Callable, eager: Callable) -> None:
        self.group, self.compiled, self.eager = group, compiled, eager

    def __call__(self, *args):
        if self.compiled is not None and available():
            try:
                return self.compiled(*args)
            except Exception as error:
                if not is_compile_error(error):
                    raise
                mark_unavailable()
                self.group.warn(f"torch.compile failed ({type(error).__name__}); using the "
                                "foreach path (same float32 arithmetic, not compiled)")
        self.compiled = None
        return self.eager(*args)  # compilation fails before the kernel runs: nothing written


# ---------------------------------------------------------------------------------------
# unmeasured steps
# ---------------------------------------------------------------------------------------


def _step_body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    """The Python kernel of one variant: gradient in its own dtype in, components updated."""

    def step(param, grad, state, packed, static, scale, key):
        coeffs, g = kernel_inputs(grad, packed, static, scale, scaled, maximize)
        kernels.fast_step(rule, strategy, param, g, state, coeffs, key, False)

    return step


def _kernel(group: GroupStep, measured: str | None = None) -> _Runner:
    """The (compiled, eager) kernel of ``group``'s variant, compiled once per process;
    ``measured``: ``"blocked"`` (CPU) or ``"wide"`` for the measured kernels."""
    scaled, maximize = group.grad_scale is not None, group.maximize
    key = (group.rule.name, group.strategy.name, scaled, maximize, measured)
    maker = {None: _step_body, "blocked": _blocked_body, "wide": _wide_body}[measured]
    body = maker(group.rule, group.strategy, scaled, maximize)
    if key not in _compiled:
        suffix = {None: "", "blocked": "_measured_cpu", "wide": "_measured"}[measured]
        options = _CPU_INDUCTOR_OPTIONS if measured == "blocked" else None
        _compiled[key] = _compile(body, _variant_name(group, suffix), options)
    return _Runner(group, _compiled[key], body)


def step_compiled(group: GroupStep, entries: list[Entry]) -> None:
    """Step ``entries`` (contiguous, one device, one flat range each) with the compiled
    kernel: the calls of :func:`eager.plan_calls`, small tensors concatenated."""
    advance_steps(entries)
    device = entries[0].param.device
    runner = _kernel(group)
    scale = group.grad_scale.to(device) if group.grad_scale is not None else None
    packed: dict[int, tuple] = {}

    def kernel(param, grad, state, step, key) -> None:
        if step not in packed:
            packed[step] = pack(group.rule, group.coefficients(step), device)
        runner(param, grad, state, *packed[step], scale, key)

    run_calls(group, plan_calls(group, entries, MAX_CALL_NUMEL, batch=True), kernel)


# ---------------------------------------------------------------------------------------
# measured steps
# ---------------------------------------------------------------------------------------


def _wide_body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    """The float64 measured kernel (CUDA; per-block strategies everywhere)."""

    def step(param, grad, state, packed, static, scale, key):
        coeffs, g = kernel_inputs(grad, packed, static, scale, scaled, maximize)
        before = kernels.represented_value(strategy, param, state)
        visible_before = param.double()
        intended = kernels.fast_step(rule, strategy, param, g, state, coeffs, key, True)
        after = kernels.represented_value(strategy, param, state)
        return update_sums(intended, after - before, param.double() - visible_before,
                           strategy.compensation_of(state))

    return step


def _blocked_body(rule, strategy, scaled: bool, maximize: bool) -> Callable:
    """The CPU kernel: every tensor is a ``(rows, cols)`` view with ``cols <= BLOCK``."""
    separate_visible = strategy.separate_visible(rule)

    def step(param, grad, state, packed, static, scale, key, row_ones):
        coeffs, g = kernel_inputs(grad, packed, static, scale, scaled, maximize)
        # row_ones: (rows, 1) float32 ones. Multiplying by it is exact and changes nothing,
        # but its per-row indexing keeps inductor from flattening the step's loops to 1-d,
        # so that they fuse with the per-row reductions (else the update and the new weight
        # go through memory: 1.5-2.5x slower)
        g = g * row_ones
        before = [t.to(torch.float32, copy=True)
                  for t in strategy.represented_parts(param, state)]
        visible_before = param.to(torch.float32, copy=True) if separate_visible else None
        intended = kernels.fast_step(rule, strategy, param, g, state, coeffs, key, True,
                                     intended_dtype=torch.float32)
        after = [t.float() for t in strategy.represented_parts(param, state)]
        e, stuck = component_change(before, after)
        ev = stuck_visible = None
        if separate_visible:
            ev, stuck_visible = component_change([visible_before], [param.float()])
        return update_sums_blocked(intended, e, stuck, ev, stuck_visible,
                                   strategy.compensation_of(state))

    return step


# Inductor stores a reused intermediate to memory once its expression exceeds
# ``realize_cpu_opcount_threshold`` operations. The measured step's landing (new weight and
# its low part) is larger than that and is read by the step and by several sums; stored, it
# splits the kernel into passes through memory (light, kahan, plus: about 2x slower). With
# the threshold out of reach it is recomputed in registers inside one loop instead.
_CPU_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 100_000,
                         "realize_cpu_opcount_threshold": 100_000}


def step_compiled_measured(group: GroupStep, entries: list[Entry]) -> None:
    """Step and measure ``entries`` (contiguous, one device, one flat range each), one
    tensor per call (its own metric keys)."""
    device = entries[0].param.device
    blocked = blocked_kernel(device, group)
    runner = _kernel(group, "blocked" if blocked else "wide")
    scale = group.grad_scale.to(device) if group.grad_scale is not None else None
    for entry in entries:
        entry.state["step"] += 1
        entry.step = int(entry.state["step"].item())
        packed = pack(group.rule, group.coefficients(entry.step), device)
        ranges = _ranges(entry.numel) if blocked else [(0, entry.numel, None)]
        sums = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        for start, stop, cols in ranges:
            args = _call_args(entry, start, stop, cols)
            sums += runner(*args[:3], *packed, scale, draw_key_at(group, entry, start),
                           *args[3:])
        group.stats.add_sums(entry.item.stat_keys, sums)


def blocked_kernel(device: torch.device, group: GroupStep) -> bool:
    """Whether the float32 CPU kernel measures ``group`` on ``device`` (every component
    shaped like the weight), rather than the float64 one."""
    return device.type == "cpu" and group.strategy.elementwise(group.rule)


def _call_args(entry: Entry, start: int, stop: int, cols: int | None) -> tuple:
    """(param, grad, state[, row_ones]) of one call: elements ``start:stop``, as ``(rows,
    cols)`` views with a ``(rows, 1)`` float32 ones tensor for the CPU kernel."""
    def part(t: torch.Tensor) -> torch.Tensor:
        t = t.view(-1)[start:stop]
        # detach: the same memory without a view base, on which dynamo would guard (and
        # recompile for every parameter shape)
        return t if cols is None else t.view(-1, cols).detach()

    if cols is None:  # whole tensor: per-block components stay as they are
        return entry.param.view(-1), entry.grad.view(-1), {
            k: v.view(-1) for k, v in entry.tensors.items()}
    tensors = (part(entry.param), part(entry.grad),
               {k: part(v) for k, v in entry.tensors.items()})
    return (*tensors, torch.ones(tensors[0].shape[0], 1, device=entry.param.device))


def _ranges(numel: int) -> list[tuple[int, int, int]]:
    """``(start, stop, cols)`` of the CPU kernel's calls: whole rows of ``BLOCK`` elements
    (at most ``MAX_CALL_NUMEL`` per call, for the int32 draw counter), then the remainder
    as one row. Two shapes, so two compilations at most: ``(rows, BLOCK)`` and ``(1, cols)``
    (dynamo specialises a dimension of size 1)."""
    bulk = numel - numel % BLOCK
    step = MAX_CALL_NUMEL - MAX_CALL_NUMEL % BLOCK
    out = [(start, min(start + step, bulk), BLOCK) for start in range(0, bulk, step)]
    if bulk < numel:
        out.append((bulk, numel, numel - bulk))
    return out
