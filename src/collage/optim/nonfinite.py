"""Finding non-finite gradients before a step changes anything.

The optimizers check every gradient for inf and nan before a step (``nonfinite="skip"`` or
``"raise"``): one read of each gradient and one host sync. Two things spare that read: a
GradScaler's own verdict (``found_inf``), and a finite norm of the very same gradients
taken by ``optimizer.clip_grad_norm_`` (:class:`FiniteProof`).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .group import PLAIN_TENSORS
from .native import any_nonfinite

__all__ = ["FiniteProof", "nonfinite_flag", "all_ranks_max", "shard_group"]


class FiniteProof(NamedTuple):
    """A gradient norm taken by ``clip_grad_norm_`` and the gradients it was taken over
    (weak references and their version counters after clipping).

    It trusts what autograd and in-place torch operations record: a write through
    ``.data``, ``detach()``, a view made under ``torch.no_grad()`` of another tensor or
    memory shared outside torch does not bump a gradient's version counter, and is not
    seen (``docs/reliability.md``)."""

    norm: torch.Tensor
    grads: list[tuple[weakref.ref, int]]

    @classmethod
    def of(cls, norm: torch.Tensor, grads: list[torch.Tensor]) -> FiniteProof:
        return cls(norm, [(weakref.ref(g), g._version) for g in grads])

    def covers(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` are exactly the tensors measured, unmodified since."""
        return len(grads) == len(self.grads) and all(
            ref() is grad and grad._version == version
            for (ref, version), grad in zip(self.grads, grads))

    def spares_check_of(self, grads: list[torch.Tensor]) -> bool:
        """Whether a step of ``grads`` needs no non-finite check: they are the tensors
        measured, unmodified since (:meth:`covers`), and the norm is finite."""
        return self.covers(grads) and self.proves_finite()

    def proves_finite(self) -> bool:
        """Whether the norm is finite (a non-finite norm proves nothing: finite gradients
        can overflow it)."""
        norm = self.norm.full_tensor() if hasattr(self.norm, "full_tensor") else self.norm
        return bool(torch.isfinite(norm))


def nonfinite_flag(grads: list[torch.Tensor], host: bool = False) -> torch.Tensor | bool:
    """1.0 if any gradient element is inf or nan, else 0.0 (a float32 scalar on the
    gradients' device, for the ranks' all-reduce). ``host``: the caller decides on the host
    (one process): where the native check reads the gradients, its verdict is returned as a
    bool, without a tensor made and read back (10-15 us of a small model's step, #31)."""
    device = grads[0].device
    # CPU: the native library, once loaded, reads each gradient once on torch's threads
    # with no per-tensor dispatch; it never builds the library itself
    verdict = any_nonfinite(grads) if device.type == "cpu" else None
    if verdict is not None:
        return verdict if host else torch.tensor(float(verdict), dtype=torch.float32)
    present = [grad for grad in grads if grad.numel()]
    if not present:
        return torch.zeros((), dtype=torch.float32, device=device)
    if device.type != "cpu" and all(grad.device == device for grad in present):
        # one multi-tensor kernel (the max-abs norm propagates nan, and inf shows) instead
        # of a launch per gradient: a model's hundreds of tensors cost one launch
        extremes = torch.stack(torch._foreach_norm(present, float("inf")))
    else:
        # aminmax reads each gradient once and propagates nan (inf shows as min or max):
        # an order of magnitude faster than isfinite(grad).all() on CPU, no temporaries.
        extremes = torch.stack([x.to(device) for grad in present for x in torch.aminmax(grad)])
    return (~torch.isfinite(extremes).all()).to(torch.float32)


def all_ranks_max(flag: torch.Tensor, group) -> torch.Tensor:
    """Sharded (FSDP2) ranks see different gradients: agree on skipping."""
    if group is not None:
        dist = torch.distributed
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


def shard_group(params):
    """The process group the parameters are sharded over (FSDP2 DTensors), or None.

    Only sharded ranks hold different parts of a tensor and see different gradients;
    replicated parameters (DDP, plain tensors) need no collective. Reducing over the
    default group instead double-counts the metrics under DDP and deadlocks an optimizer
    that only some ranks step. HSDP's (Replicate, Shard) mesh reduces over the shard dim.
    """
    params = list(params)
    if set(map(type, params)) <= PLAIN_TENSORS:  # the common case: one pass in C
        return None
    for param in params:
        if param.__class__ in PLAIN_TENSORS:  # without getattr's miss
            continue
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            continue
        dims = [i for i, p in enumerate(param.placements) if p.is_shard()]
        if len(dims) > 1:
            raise NotImplementedError(
                "collage optimizers support parameters sharded over one mesh "
                f"dimension, got placements {param.placements}")
        if dims and mesh.size(dims[0]) > 1:
            return mesh.get_group(dims[0])
    return None
