"""``grad_accumulation="pair"``: the gradients of several backward passes summed in float32,
not in the weight dtype as autograd sums them, at 2 bytes per parameter beyond ``p.grad``
(``docs/memory.md``).

The running float32 sum ``S`` of a bf16 parameter's gradients is kept as a pair:

* its **high half**, ``S`` rounded to the nearest bf16 (ties away from zero), in ``p.grad``,
  where torch's own tools (``model.zero_grad``, ``clip_grad_norm_``, norms, logging) see it;
* its **low half**, the int16 ``bits(S) - bits(high) * 2**16``, in the optimizer
  (:class:`GradSums`). Together exactly ``S``, 4 bytes per parameter (:func:`split`,
  :func:`combine`).

Two hooks per parameter (:class:`PairHooks`) move each backward's gradient ``g`` into the
sum: before autograd's accumulation, ``p.grad`` (the high half) is set aside and ``p.grad``
set to None, so that autograd stores ``g`` alone, unrounded; after it, ``S + g`` (one
float32 rounding: ``S`` is bit for bit the sequential float32 sum) is split again into
``p.grad`` and the low half. ``step()`` steps on ``S`` itself, a float32 gradient
(``stepping.gather``, :meth:`GradSums.gradients`).

What the user does to ``p.grad`` wins: the low half counts only while ``p.grad`` is the
tensor the hook left there, unmodified (its version counter). ``p.grad = None``
(``model.zero_grad()``) drops it; a gradient clipped in place or set by hand is used as it
is. fp16 weights keep the whole float32 sum (4 bytes beside ``p.grad``: the high half of a
float32 is not an fp16); float32 and float64 weights are left to autograd, which sums
them in their own precision.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch

from .hooks import HookSet, refuse_data_parallel, weakly
from .step_hooks import never_traced

__all__ = ["GradSums", "PairHooks", "combine", "split"]

#: half a bf16 ulp, in float32 bit patterns: bf16 keeps the top 16 of a float32's 32 bits
_HALF = 0x8000
#: a quiet float32 nan
_NAN_BITS = 0x7FC00000


def split(total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) of a float32 tensor: ``high``, bf16, is ``total`` rounded to nearest with
    ties away from zero; ``low``, int16, is ``bits(total) - bits(high) * 2**16``.

    Why it is exact: the bits of a float32 are its sign and magnitude, and adding
    ``0x8000`` to them, then dropping the low 16 bits, rounds the magnitude to the nearest
    multiple of ``2**16`` (half up): so ``bits(total) - bits(high) << 16`` lies in
    ``[-0x8000, 0x7FFF]``, an int16, for every finite or infinite ``total`` (a magnitude
    rounded past the largest bf16 gives the bits of inf: the same inf as torch's rounding).
    A nan is made the quiet nan first (its bits plus ``0x8000`` could carry into the sign).
    int32 arithmetic throughout; ``>> 16`` of a negative int32 is a floor (arithmetic)."""
    bits = total.view(torch.int32)
    bits = torch.where(total.isnan(), _NAN_BITS, bits)
    high = (bits + _HALF) >> 16
    low = (bits - high * 65536).to(torch.int16)
    return high.to(torch.int16).view(torch.bfloat16), low


def combine(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 ``bits(high) * 2**16 + low`` (:func:`split`'s inverse): exact int32
    arithmetic (``high`` of -0.0 pairs with a non-negative ``low`` only)."""
    bits = high.view(torch.int16).to(torch.int32) * 65536 + low
    return bits.view(torch.float32)


class _Held:
    """One parameter's part of the sum held by the optimizer: ``low`` (int16 for bf16; the
    whole float32 sum for fp16; None where ``p.grad`` is the sum exactly, after one
    backward), valid while ``p.grad`` is ``grad`` at ``version``."""

    __slots__ = ("low", "grad", "version")

    def __init__(self, low: torch.Tensor | None, grad: torch.Tensor) -> None:
        self.low = low
        self.grad = weakref.ref(grad)  # weakly: p.grad = None frees it
        self.version = grad._version

    def current(self, param: torch.Tensor) -> bool:
        grad = param.grad
        return grad is not None and grad is self.grad() and grad._version == self.version


class GradSums:
    """The optimizer's half of each parameter's running sum (see the module docstring):
    ``before`` and ``after`` run around autograd's accumulation (:class:`PairHooks`);
    the step reads the sums (:meth:`gradients`). Never a copy of ``p.grad``: 2 bytes per
    bf16 parameter."""

    def __init__(self) -> None:
        #: ``id(param)``: (param, its held part)
        self._held: dict[int, tuple[torch.Tensor, _Held]] = {}
        #: ``id(param)``: (param, the ``p.grad`` set aside by ``before``): until ``after``
        self._aside: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._held) + len(self._aside)

    @torch.no_grad()
    def before(self, param: torch.Tensor) -> None:
        """Autograd is about to add this backward's gradient into ``p.grad``: set the high
        half aside (``p.grad = None``), so that autograd stores the gradient alone."""
        if param.dtype not in (torch.bfloat16, torch.float16):
            return  # autograd sums float32 and float64 gradients in their own precision
        self._settle(param)
        if param.grad is not None:
            self._aside[id(param)] = (param, param.grad)
            param.grad = None

    @torch.no_grad()
    def after(self, param: torch.Tensor) -> None:
        """``p.grad`` is this backward's gradient ``g`` alone: the sum becomes ``S + g``,
        one float32 rounding, split again into ``p.grad`` and the low half."""
        if param.dtype not in (torch.bfloat16, torch.float16):
            return
        grad = param.grad
        aside = self._aside.pop(id(param), None)
        entry = self._held.get(id(param))
        if aside is None:  # the first gradient: the sum is g, exactly (low half zero)
            self._held[id(param)] = (param, _Held(None, grad))
            return
        low = None if entry is None else entry[1].low
        if param.dtype == torch.float16:
            total = aside[1].float() if low is None else low
            total = total + grad  # (float32 + fp16: the fp16 exactly widened)
            param.grad = high = total.to(torch.float16)
            self._held[id(param)] = (param, _Held(total, high))
            return
        total = aside[1].float() if low is None else combine(aside[1], low)
        total += grad  # float32 += (exactly widened) bf16: one rounding
        high, low = split(total)
        param.grad = high
        self._held[id(param)] = (param, _Held(low, high))

    def _settle(self, param: torch.Tensor) -> _Held | None:
        """``param``'s held part if ``p.grad`` is still the high half the hook left, else
        dropped (the user's ``p.grad`` wins) and None. A ``before`` with no ``after``
        (``torch.autograd.grad(loss, params)`` runs the first hook only) gives its ``p.grad``
        back."""
        key = id(param)
        aside = self._aside.pop(key, None)
        if aside is not None and param.grad is None:
            param.grad = aside[1]
        entry = self._held.get(key)
        if entry is None:
            return None
        if not entry[1].current(param):
            del self._held[key]
            return None
        return entry[1]

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step uses: the float32 sum where the optimizer holds a low
        half (a new tensor), else ``p.grad``."""
        held = self._settle(param)
        if held is None or held.low is None:
            return param.grad
        if param.dtype == torch.float16:
            return held.low
        return combine(param.grad, held.low)

    def gradients(self, params: list[torch.Tensor], grads: list) -> list:
        """``grads`` (each ``p.grad``) with the float32 sums of the parameters whose sums
        the optimizer holds (``stepping.gather``)."""
        held, aside = self._held, self._aside
        return [self.gradient(p) if id(p) in held or id(p) in aside else g
                for p, g in zip(params, grads)]

    def sum_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The float32 sum of ``param``'s gradients (None where ``p.grad`` is None)."""
        grad = self.gradient(param)
        return None if grad is None else grad.float()

    def settle(self) -> None:
        """Every held part checked against ``p.grad`` now (:meth:`_settle`)."""
        for param, _ in [*self._aside.values(), *self._held.values()]:
            self._settle(param)

    def drop_lows(self) -> None:
        """Let ``p.grad`` alone be the gradient: GradScaler's ``unscale_`` divided it in
        place without moving its version counter, and could not divide the low halves."""
        self.settle()
        self._held.clear()

    def clear(self) -> None:
        self._held.clear()
        self._aside.clear()


class PairHooks(HookSet):
    """:class:`hooks.HookSet` with a second hook per parameter: a tensor hook
    (``register_hook``, run before autograd's accumulation: ``GradSums.before``) beside the
    post-accumulate-grad hook (``GradSums.after``), both on the optimizer's ``_sums``, held
    weakly, and idle while the optimizer is paused."""

    def __init__(self, owner: object, what: str) -> None:
        super().__init__(owner, _after, what)
        #: ``id(param)``: the tensor hook's handle
        self._before_handles: dict[int, object] = {}
        #: ``id(param)``: its AccumulateGrad node (kept: torch reuses a live one)
        self._accumulators: dict[int, object] = {}

    def sync(self, params: Iterable[torch.Tensor]) -> None:
        super().sync(params)
        for key, (param, _) in self._handles.items():
            if key not in self._before_handles:
                self._before_handles[key] = param.register_hook(
                    functools.partial(weakly(self._before), weakref.ref(param)))
                with torch.enable_grad():
                    self._accumulators[key] = param.view_as(param).grad_fn.next_functions[0][0]

    def _unhook(self, key: int) -> None:
        handle = self._before_handles.pop(key, None)
        if handle is not None:
            handle.remove()
        self._accumulators.pop(key, None)
        super()._unhook(key)

    def _accumulates(self, param: torch.Tensor) -> bool:
        """Whether this backward adds into ``p.grad``: not ``torch.autograd.grad(...)``
        (it runs the tensor hook, never the accumulation nor the post hook), nor a
        ``backward(inputs=...)`` that leaves ``param`` out. torch's engine answers, and
        refuses the question for a leaf inside ``autograd.grad``: that refusal is the
        answer there."""
        node = self._accumulators.get(id(param))
        if node is None:
            return True
        try:
            return torch._C._will_engine_execute_node(node)
        except RuntimeError:  # "...we are currently running autograd.grad()"
            return False

    # Autograd calls the hooks in the middle of backward: never traced
    @never_traced
    def _before(self, param_ref: weakref.ref, grad: torch.Tensor) -> None:
        param = param_ref()
        owner = self.active_owner(param)
        if owner is not None:
            refuse_data_parallel((), self.what)  # a process group made since
            if self._accumulates(param):
                owner._sums.before(param)


@never_traced
def _after(owner, param: torch.Tensor) -> None:
    owner._sums.after(param)
