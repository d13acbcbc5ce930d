"""What ``torch.optim.Optimizer`` does around every optimizer's ``step`` and in its
``zero_grad``, without the profiler record torch enters on every call, profiler or not
(``record_function``: 13 us a call on a 2-vCPU AMD EPYC, as much as a small model's whole
check of its tensors; #40, #31). Where a profiler runs, the records are torch's, under
torch's names."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
# torch's registries of global step hooks (``register_optimizer_step_pre_hook``), read as
# torch's own wrapper (``Optimizer.profile_hook_step``) reads them
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

__all__ = ["never_traced", "optimizer_step", "zero_grads"]

#: ``fn`` never traced by dynamo: called from a compiled function, it runs eagerly (a graph
#: break), as ``torch.compiler.disable(fn)`` does, but torch._dynamo is imported at its first
#: call instead of where it is applied. ``torch.compiler.disable`` imports torch._dynamo at
#: once: applied at import time (the step's wrapper, the autograd hooks), it made ``import
#: collage`` take 1.3 s more than ``import torch`` (2026-12-06, AMD EPYC: 3.7 s against
#: 2.1). torch.optim's own methods use this one for the same reason; dynamo skips the
#: module it lives in (``torch._compile``), so the call is never traced either way.
never_traced = torch._disable_dynamo


def _profiling() -> bool:
    return torch._C._autograd._profiler_enabled()


def optimizer_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` run as torch.optim runs an optimizer's step (``profile_hook_step``): the
    global then the optimizer's step pre-hooks (each may return new ``(args, kwargs)``),
    the step under ``no_grad``, ``_optimizer_step_code`` (where torch's profiler sees a
    step), the optimizer's then the global post-hooks; recorded as
    ``Optimizer.step#<class>.step`` only while a profiler runs. Never traced by dynamo:
    inside a torch.compile'd training step, inductor would drop the bf16 round trips the
    compensation terms are made of (weight_lo and the Kahan compensation become 0); the
    step runs eagerly there (fused=True compiles its own kernels with the casts kept).
    ``hooked`` tells torch's ``_patch_step_function`` not to wrap it again."""
    body = never_traced(torch.no_grad()(step))

    @functools.wraps(step)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        if _profiling():
            with torch.autograd.profiler.record_function(
                    f"Optimizer.step#{type(args[0]).__name__}.step"):
                return _hooks_around(body, args, kwargs)
        return _hooks_around(body, args, kwargs)

    hooked.hooked = True  # type: ignore[attr-defined]
    return hooked


def _hooks_around(step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """torch's order and contract for the step hooks (``profile_hook_step``)."""
    optimizer = args[0]
    for pre_hook in itertools.chain(_global_optimizer_pre_hooks.values(),
                                    optimizer._optimizer_step_pre_hooks.values()):
        result = pre_hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{step} must return None or a tuple of (new_args, "
                                   f"new_kwargs), but got {result}.")
            args, kwargs = result
    out = step(*args, **kwargs)
    optimizer._optimizer_step_code()
    for post_hook in itertools.chain(optimizer._optimizer_step_post_hooks.values(),
                                     _global_optimizer_post_hooks.values()):
        post_hook(optimizer, args, kwargs)
    return out


def zero_grads(optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
    """torch's ``zero_grad`` loop for ``set_to_none`` (every gradient set to None) where no
    profiler runs; False, with nothing done, otherwise (``set_to_none=False`` or a
    profiler: the caller runs torch's own, which records ``Optimizer.zero_grad#...``)."""
    if not set_to_none or _profiling():
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                param.grad = None
    return True
