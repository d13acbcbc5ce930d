"""The non-finite policy: finding non-finite gradients before a step changes anything, and
what a step does then (``nonfinite=``: skip, raise or ignore), with the skipped steps' count.

The optimizers check every gradient for inf and nan before a step (``nonfinite="skip"`` or
``"raise"``): one read of each gradient and one host sync. Two things spare that read: a
GradScaler's own verdict (``found_inf``), and a finite norm of the very same gradients
taken by ``optimizer.clip_grad_norm_`` (:class:`FiniteProof`). Where every group runs the
Triton kernels the verdict stays on the device and the kernels skip on it
(:func:`gradients_usable`, :func:`check_on_device`); its skips are counted there and read
when ``skipped_steps`` is (:func:`settle_skips`). A step of every group by its native plan
checks in its own C call (``stepping.step_planned``). Under ``step_in_backward`` the
verdict is per parameter, in its hook (:func:`finite_in_backward`).

The functions of the optimizer read its policy (``nonfinite``), GradScaler's ``found_inf``
and the state it keeps: ``_finite_proof``, ``_unchecked``, ``_device_skips`` and the
host's count (``skipped_steps``).
"""

from __future__ import annotations

import itertools
import operator
import warnings
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import dispatch
from .group import ITEM_GRAD, PLAIN_TENSORS, GroupStep, Item, local
from .native import any_nonfinite

__all__ = ["NONFINITE_POLICIES", "FiniteProof", "nonfinite_flag", "all_ranks_max",
           "shard_group", "gradients_usable", "verdict_device", "check_on_device",
           "count_device_verdict", "settle_skips", "report_nonfinite", "finite_in_backward",
           "report_skipped"]

NONFINITE_POLICIES = ("skip", "raise", "ignore")

#: (group index, group, items): a step's gathered groups (``stepping.gather``)
Batches = Sequence[tuple[int, dict, list[Item]]]

_IS_META = operator.attrgetter("is_meta")


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


# ----------------------------------------------------------------------- a step's verdict

def gradients_usable(optimizer, batches: Batches, sharded, groups: list[GroupStep]) -> bool:
    """Apply the GradScaler verdict and the non-finite policy: with one host sync, or,
    where every group's path reads it on the device (``dispatch.verdict_on_device``),
    with none: the verdict goes to the groups and the kernels skip on it. (A step of
    every group by its native plan checks in its own C call: ``stepping.step_planned``.)
    False: the step is refused (skipped, counted), nothing changed."""
    # good for one step at most
    proof, optimizer._finite_proof = optimizer._finite_proof, None
    optimizer._unchecked = None  # (a step that raised before making its verdict left one)
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None:
        # GradScaler already checked every gradient; it skips (and we count) on overflow.
        if bool(found_inf.item() > 0):
            optimizer.skipped_steps += 1
            return False
        return True
    if optimizer.nonfinite == "ignore":
        return True
    # a meta tensor holds no values to check (torch.optim steps meta parameters too)
    # is_meta, not device.type: a device object per tensor costs about 1 us (#31)
    grads = list(itertools.chain.from_iterable(map(ITEM_GRAD, items)
                                               for _, _, items in batches))
    if any(map(_IS_META, grads)):
        grads = [grad for grad in grads if not grad.is_meta]
    if not grads:
        return True
    # A finite norm of these very gradients (clip_grad_norm_) proves every element
    # finite: the check's read of every gradient is skipped.
    if proof is not None and sharded is None and proof.spares_check_of(grads):
        return True
    device = verdict_device(groups) if optimizer.nonfinite == "skip" else None
    on_device = device is not None and all(map(dispatch.verdict_on_device, groups))
    local_grads = (grads if set(map(type, grads)) <= PLAIN_TENSORS
                   else [local(grad) for grad in grads])
    if on_device and sharded is None:
        # the verdict is made once the groups are prepared (check_on_device): a
        # planned Triton group checks its gradients in kernels over its own tiles
        bad = torch.empty((), dtype=torch.float32, device=device)
        for group in groups:
            group.found_nonfinite = bad
        optimizer._unchecked = (bad, batches)
        return True
    if sharded is None and not on_device:
        # one process, decided on the host: the native check's verdict as a bool where
        # it reads the gradients (no flag tensor made and read back)
        bad = nonfinite_flag(local_grads, host=True)
    else:
        bad = all_ranks_max(nonfinite_flag(local_grads), sharded)
    if on_device:  # counted by step() once every group is prepared (nothing raised)
        for group in groups:
            group.found_nonfinite = bad
        return True
    if not (bad if isinstance(bad, bool) else bool(bad.item())):
        return True
    report_nonfinite(optimizer, batches)
    return False


def verdict_device(groups: list[GroupStep]) -> torch.device | None:
    """The one device the groups' parameters are on (each group's first parameter's: the
    device its kernels run on), where a verdict left on the device can be read by every
    group's kernels; None where the groups span several devices (a model split over GPUs
    in one process): a kernel on one GPU cannot read a flag in another's memory (without
    peer access, an illegal address), so the verdict is made on the host. A group whose
    own parameters span devices steps those off its first one's device with the eager
    kernel, which reads the verdict on the host (``triton.path.step_triton``)."""
    devices = {local(group.items[0].param).device for group in groups if group.items}
    return devices.pop() if len(devices) == 1 else None


def check_on_device(optimizer, prepared: list) -> None:
    """Make the device verdict :func:`gradients_usable` left to be made (the default
    policy, one process, every group on the Triton kernels), once the groups are
    prepared: a group its Triton plan steps checks its gradients with the plan's
    kernels (``dispatch.check_planned``: over the step's own tiles, no Python per
    tensor); the others' gradients by ``nonfinite_flag``, first (it writes the
    verdict, the kernels only raise it). Nothing is read on the host."""
    unchecked, optimizer._unchecked = optimizer._unchecked, None
    if unchecked is None:
        return
    bad, batches = unchecked
    planned = [ready is not None and dispatch.checks_planned(ready)
               for _, ready in prepared]
    rest = [item.grad for (_, _, items), done in zip(batches, planned) if not done
            for item in items if not item.grad.is_meta]
    if rest:
        bad.copy_(nonfinite_flag([local(grad) for grad in rest]))
    else:
        bad.zero_()
    for (_, ready), done in zip(prepared, planned):
        if done:
            dispatch.check_planned(ready, bad)


def report_nonfinite(optimizer, batches: Batches) -> None:
    """A non-finite gradient refuses the step: raise (``nonfinite="raise"``), or count
    the skipped step and warn, naming the parameters."""
    # a meta gradient holds no values (the check passed over it too)
    names = [item.name for _, _, items in batches for item in items
             if not item.grad.is_meta and not bool(torch.isfinite(local(item.grad)).all())]
    where = ", ".join(repr(n) for n in names[:5]) or "(another rank)"
    if optimizer.nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradient in parameter {where}; nothing was updated. Use "
            "nonfinite='skip' to skip such steps, or find the overflow (fp16 needs loss "
            "scaling: torch.amp.GradScaler)"
        )
    optimizer.skipped_steps += 1
    warnings.warn(f"collage: skipped step: non-finite gradient in {where} "
                  f"({optimizer.skipped_steps} skipped so far); weights and states unchanged",
                  RuntimeWarning, stacklevel=4)


# ----------------------------------------------------------------------- skip counts

def count_device_verdict(optimizer, groups: list[GroupStep]) -> None:
    """Count the verdict :func:`gradients_usable` left on the device (the same tensor
    in every group), if it did: after every group was prepared, so that a step that
    raises counts no skip."""
    for group in groups:
        if group.found_nonfinite is not None:
            _count_on_device(optimizer, group.found_nonfinite)
            return


def _count_on_device(optimizer, bad: torch.Tensor) -> None:
    """Add a device verdict to the skipped steps' count kept there (float64: exact), read
    when ``skipped_steps`` is (:func:`settle_skips`)."""
    skips = optimizer._device_skips
    if skips is None or skips.device != bad.device:
        settle_skips(optimizer)
        optimizer._device_skips = bad.to(torch.float64)
    else:
        skips.add_(bad)


def settle_skips(optimizer) -> None:
    """Read the steps the kernels skipped on the device's verdict (one host sync), count
    them and warn once for them (their gradients are gone: no names)."""
    pending, optimizer._device_skips = optimizer._device_skips, None
    if pending is None:
        return
    skipped = int(pending.item())
    if skipped:
        counted = optimizer.__dict__
        counted["skipped_steps"] += skipped
        warnings.warn(f"collage: skipped {skipped} step(s) on a non-finite gradient, "
                      f"found on the device ({counted['skipped_steps']} skipped so "
                      "far); weights and states unchanged", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------- in backward

def finite_in_backward(optimizer, cycle, item: Item) -> bool:
    """The non-finite policy for one parameter stepped in backward (``cycle``: the
    hooks' ``backward.Cycle``): the others' gradients do not exist yet, so the verdict is
    per parameter (``docs/memory.md``). False: skipped (named in ``cycle.skipped``)."""
    if optimizer.nonfinite == "ignore" or item.grad.device.type == "meta":
        return True
    if not bool(nonfinite_flag([local(item.grad)]).item()):
        return True
    if optimizer.nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradient in parameter {item.name!r}; it was not updated, but "
            "with step_in_backward=True the parameters whose gradients completed "
            "earlier in this backward were. Use nonfinite='skip' to skip such a "
            "parameter's update, or find the overflow")
    cycle.skipped.append(item.name)
    return False


def finite_items_in_backward(optimizer, cycle, items: list[Item]) -> list[Item]:
    """:func:`finite_in_backward` over a bucket of the step in backward: one read of every
    gradient where all are finite (the common case: one native call instead of one per
    parameter), and the per-parameter verdicts only where one is not."""
    if optimizer.nonfinite == "ignore":
        return items
    grads = [local(item.grad) for item in items if item.grad.device.type != "meta"]
    if not grads or not bool(nonfinite_flag(grads, host=True)):
        return items
    return [item for item in items if finite_in_backward(optimizer, cycle, item)]


def report_skipped(optimizer, cycle) -> None:
    """At step(): count a step whose backward skipped parameters as one skipped step,
    and say which were skipped."""
    if not cycle.skipped:
        return
    optimizer.skipped_steps += 1
    where = ", ".join(repr(n) for n in cycle.skipped[:5])
    warnings.warn(f"collage: step in backward skipped {len(cycle.skipped)} parameter(s) "
                  f"on a non-finite gradient ({where}); they and their states are "
                  "unchanged, the other parameters were stepped", RuntimeWarning,
                  stacklevel=5)
