"""The per-parameter hooks of ``step_in_backward`` and ``grad_accumulation="pair"``: who
holds them, when they do nothing, and where they cannot be right.

* :class:`HookSet`: one hook per parameter of one optimizer, holding the optimizer weakly.
  A frozen parameter (``requires_grad=False``: torch cannot hook it, and it gets no
  gradient) is hooked once it requires a gradient (:meth:`HookSet.refresh`, at each step).
  While the optimizer is paused (``with opt.paused():``) the hooks do nothing and autograd
  leaves the gradients in ``p.grad`` as it does without us.
* One owner per parameter, process-wide (:func:`take_over`): a new collage optimizer over a
  parameter releases an older one's hook on it, so that two optimizers never both take the
  gradient. ``opt.release_hooks()`` releases all of one optimizer's hooks.
* :func:`refuse_data_parallel`: FSDP2 and DDP, where the hook sees the wrong gradient.
* :func:`inside_reentrant_backward`: a hook running in the nested backward of a reentrant
  activation checkpoint (``use_reentrant=True``) sees only that segment's part of the
  gradient.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.autograd.function import BackwardCFunction

from .step_hooks import never_traced

__all__ = ["HookSet", "inside_reentrant_backward", "refuse_data_parallel", "take_over",
           "weakly"]

#: The frame of a custom autograd Function's backward (``Function.apply`` in backward).
#: Reentrant checkpointing (torch.utils.checkpoint with ``use_reentrant=True``, and the
#: libraries built like it) runs a nested ``torch.autograd.backward`` from there.
_FUNCTION_BACKWARD = BackwardCFunction.apply.__code__


def inside_reentrant_backward() -> bool:
    """Whether the calling hook runs inside a nested backward, started from the backward of
    a custom autograd Function (reentrant checkpointing). The gradient accumulated there is
    one segment's part: the same parameter may receive more in the enclosing backward or
    another segment. A hook of an ordinary backward has no such frame below it: autograd
    calls it from the engine, which the caller's ``backward()`` entered from Python. On a
    device's autograd thread the nested backward's frames are on that thread, as here."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False


def refuse_data_parallel(params: Iterable[torch.Tensor], what: str) -> None:
    """Refuse where the hook cannot see the gradient the step must use.

    FSDP2 (parameters are DTensors): it reduce-scatters after backward and assigns the
    sharded ``.grad`` itself, outside autograd's accumulation, so no hook ever fires on the
    parameters the optimizer holds. DDP (plain tensors, a process group of several ranks):
    torch runs the hook when the *local* gradient is complete, before DDP's all-reduce, so a
    step there would use this rank's gradient only, and accumulated gradients would bypass
    the reduction. Neither can be made right from the optimizer: refuse, saying so.
    """
    for param in params:
        if hasattr(param, "device_mesh"):
            raise NotImplementedError(
                f"{what} is not supported with FSDP2 (DTensor parameters): FSDP2 assigns the "
                "reduce-scattered gradient after backward, outside autograd, so the hook that "
                f"{what} relies on never fires; leave it off (FSDP2 already frees the "
                "unsharded gradients)")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise NotImplementedError(
            f"{what} is not supported under DDP (a process group of "
            f"{dist.get_world_size()} ranks): torch runs the per-parameter hook on the local "
            "gradient, before DDP's all-reduce, so the step would not see the reduced "
            "gradient; leave it off under data parallelism")


#: ``id(param)``: (the parameter, the hook set holding its hook), weakly
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def take_over(params: Iterable[torch.Tensor], keeper: object | None) -> None:
    """``params`` join an optimizer whose hook set is ``keeper`` (None: it hooks nothing):
    a hook another live optimizer holds on one of them is released, with one warning, so
    that the older optimizer stops taking gradients the new one must see."""
    released = []
    for param in params:
        entry = _OWNERS.get(id(param))
        if entry is None:
            continue
        holder = entry[1]()
        if entry[0]() is not param or holder is None:
            del _OWNERS[id(param)]
        elif holder is not keeper:
            holder.release(param)
            released.append(holder.what)
    if released:
        warnings.warn(
            f"collage: {len(released)} parameter(s) had a hook of an earlier collage "
            f"optimizer ({released[0]}), which took their gradients during backward; the "
            "hooks are released, so the new optimizer sees the gradients (release them "
            "yourself with old_optimizer.release_hooks(); docs/memory.md)",
            RuntimeWarning, stacklevel=4)


def weakly(method: Callable) -> Callable:
    """``method`` (bound) called through a weak reference to its object, for a hook stored
    on a tensor: the hook must not hold the hook set, which holds the tensor. That cycle
    runs through autograd's hook storage, which the garbage collector does not see, so a
    model and its optimizer were never freed (``del model, opt; gc.collect()``) under
    ``step_in_backward`` or ``grad_accumulation="pair"``. Once the set is gone the hook
    does nothing."""
    ref = weakref.WeakMethod(method)

    @never_traced  # autograd calls it in the middle of backward
    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return call


class HookSet:
    """One post-accumulate-grad hook per parameter, calling ``on_ready(owner, param)``. The
    hook holds the optimizer weakly: a dropped optimizer leaves no live hook behind (a hook
    of a dead optimizer does nothing). ``what``: the feature the hooks serve, for errors."""

    def __init__(self, owner: object, on_ready: Callable[[object, torch.Tensor], None],
                 what: str) -> None:
        self._owner = weakref.ref(owner)
        self._on_ready = on_ready
        self.what = what
        #: ``id(param)``: (param, handle)
        self._handles: dict[int, tuple[torch.Tensor, object]] = {}
        #: ``id(param)``: the parameters wanted but frozen when last synced
        self._frozen: dict[int, torch.Tensor] = {}

    def admit(self, params: list[torch.Tensor]) -> None:
        """The optimizer's parameters now: refused where the hook cannot see the gradient
        the step must use (:func:`refuse_data_parallel`), else hooked (:meth:`sync`)."""
        refuse_data_parallel(params, self.what)
        self.sync(params)

    def sync(self, params: Iterable[torch.Tensor]) -> None:
        """Hook exactly ``params``: new ones hooked, those no longer there unhooked; frozen
        ones remembered, to be hooked once they require a gradient (:meth:`refresh`)."""
        wanted = {id(p): p for p in params}
        for key in [k for k in self._handles if k not in wanted]:
            self._unhook(key)
        self._frozen = {}
        for key, param in wanted.items():
            if key in self._handles:
                continue
            if not param.requires_grad:
                self._frozen[key] = param
                continue
            handle = param.register_post_accumulate_grad_hook(weakly(self._hook))
            self._handles[key] = (param, handle)
            _OWNERS[key] = (weakref.ref(param), weakref.ref(self))

    def refresh(self) -> None:
        """Hook the remembered frozen parameters that now require a gradient (one
        attribute read each; nothing where none was frozen)."""
        if self._frozen and any(p.requires_grad for p in self._frozen.values()):
            self.sync([*(p for p, _ in self._handles.values()), *self._frozen.values()])

    def release(self, param: torch.Tensor) -> None:
        """Remove the hook on ``param`` (another optimizer takes its gradients)."""
        if id(param) in self._handles and self._handles[id(param)][0] is param:
            self._unhook(id(param))
        self._frozen.pop(id(param), None)

    def remove(self) -> None:
        for key in list(self._handles):
            self._unhook(key)
        self._frozen.clear()

    def _unhook(self, key: int) -> None:
        self._handles.pop(key)[1].remove()
        entry = _OWNERS.get(key)
        if entry is not None and entry[1]() is self:
            del _OWNERS[key]

    def _hook(self, param: torch.Tensor) -> None:
        owner = self.active_owner(param)
        if owner is not None:
            self._on_ready(owner, param)

    def active_owner(self, param: torch.Tensor | None) -> object | None:
        """The optimizer a hook on ``param`` serves now: None where it was dropped, is
        paused, or where ``param`` is not one hooked here (a copy of a parameter that
        carried the hook along must not feed its gradient to this optimizer)."""
        owner = self._owner()
        known = self._handles.get(id(param))
        if owner is None or known is None or known[0] is not param \
                or owner.__dict__.get("_hooks_paused", False):
            return None
        return owner
