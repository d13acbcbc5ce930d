"""The fused path: the float32-register kernel compiled by torch.compile.

Inductor turns each (rule, strategy) kernel into one loop over memory (C++/OpenMP on CPU,
Triton on CUDA). Tensors are passed flattened with dynamic shapes, and per-step coefficients
arrive as 0-d tensors, so one compilation per (rule, strategy, tracking on/off) serves every
parameter size and every learning rate. Where compilation cannot work (no C++ compiler, no
Triton, an inductor failure) the optimizer falls back to the eager float32 kernel with one
warning: ``compiled_step`` returns None from then on.
"""

from __future__ import annotations

import shutil

import torch

from . import kernels

__all__ = ["compiled_step", "mark_unavailable", "is_compile_error"]

_compiled: dict[tuple[str, str], object] = {}
_unavailable = False


def _compiler_present() -> bool:
    try:
        from torch._inductor import config
    except Exception:  # pragma: no cover - stripped builds
        return False
    compiler = getattr(config.cpp, "cxx", (None, "g++"))
    names = compiler if isinstance(compiler, (tuple, list)) else (compiler,)
    return any(name and shutil.which(name) for name in names)


def _kernel_for(rule, strategy):
    # A closure per (rule, strategy): dynamo guards and recompile budgets stay separate.
    def step(param, grad, state, coeffs, generator, want_intended):
        return kernels.fast_step(rule, strategy, param, grad, state, coeffs, generator,
                                 want_intended)

    # emulate_precision_casts: without it inductor may skip a bf16 round trip (store, then
    # reload as float32) and keep float32 bits, which would make every residual zero.
    return torch.compile(step, dynamic=True, options={"emulate_precision_casts": True})


def compiled_step(rule, strategy):
    """The compiled kernel for (rule, strategy), or None where compilation is unavailable."""
    if _unavailable or not hasattr(torch, "compile"):
        return None
    key = (rule.name, strategy.name)
    if key not in _compiled:
        if not _compiler_present():
            mark_unavailable()
            return None
        _compiled[key] = _kernel_for(rule, strategy)
    return _compiled[key]


def mark_unavailable() -> None:
    """Stop trying to compile in this process (after a failure)."""
    global _unavailable
    _unavailable = True


def is_compile_error(error: BaseException) -> bool:
    """Errors raised by dynamo/inductor while building a kernel (not by our numerics)."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))
