"""``grad_accumulation="pair"``: the gradients of several backward passes summed in the
optimizer more precisely than autograd's accumulation in the weight dtype (``docs/memory.md``).

The hooks that feed it are in ``backward.py``; the optimizer keeps one :class:`GradSums` as
``_sums``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["WRITTEN_AFTER", "GradSums"]

WRITTEN_AFTER = (
    "parameter {name!r} has a gradient written after backward's hook ran: {what}. Something "
    "wrote p.grad after autograd's accumulation; DDP does (the all-reduced gradient, at the "
    "end of backward), so the hook saw the local gradient only. This is not supported under "
    "DDP: leave step_in_backward and grad_accumulation at their defaults there")


class GradSums:
    """The float32 running sum of each parameter's gradients over the backward passes since
    the last ``step()`` or ``zero_grad()`` (``grad_accumulation="pair"``).

    A float32 is the pair (its high half, which is a bf16, and a 16-bit low half): 4 bytes,
    2 more than the bf16 gradient buffer of plain accumulation. Each gradient is added
    exactly converted (bf16 and fp16 values are float32 values) with one float32 rounding,
    so the sum is bit for bit the sequential float32 sum of the gradients. A TwoSum pair of
    bf16 (``collage.mcf.eft.grow``) holds about 17 significant bits and errs by up to about
    2**-16 of the running sum per addition: measured in
    ``docs/benchmarks/intel-xeon-2c_2026-12-05_grad-accum.md``, it misses the goal of
    2**-16 relative to the float32 sum that the float32 sum meets by construction.
    """

    def __init__(self) -> None:
        #: ``id(param)``: (param, its float32 running sum)
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._sums)

    def fold(self, param: torch.Tensor) -> None:
        """Add ``param.grad`` to its running sum and free it (``param.grad = None``), so that
        the next backward's gradient is not added to it in the weight dtype."""
        grad = param.grad
        if grad is None:
            return
        entry = self._sums.get(id(param))
        if entry is None:
            # exact (bf16/fp16 -> float32); a float32 gradient is copied, never aliased
            self._sums[id(param)] = (param, grad.to(torch.float32, copy=True))
        else:
            entry[1].add_(grad)  # float32 += (exactly widened) gradient: one rounding
        param.grad = None

    def sum_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The running float32 sum of ``param``'s gradients (None if none since the last
        step): read-only use."""
        entry = self._sums.get(id(param))
        return None if entry is None else entry[1]

    def write_grads(self, name_of: Callable[[torch.Tensor], str]) -> None:
        """Write each running sum, rounded once to the weight dtype, into ``p.grad``,
        freeing the sums one by one: the peak is the gradients plus one parameter's sum. A
        ``p.grad`` written since the hook freed it is refused (DDP writes one), before
        anything changes."""
        for param, _ in self._sums.values():
            if param.grad is not None:
                raise RuntimeError(WRITTEN_AFTER.format(
                    name=name_of(param), what="grad_accumulation='pair' moved the "
                    "gradient into the optimizer's float32 sum, and freed it"))
        while self._sums:
            _, (param, total) = self._sums.popitem()
            param.grad = total.to(param.dtype)
            del total

    def clear(self) -> None:
        self._sums.clear()
