"""Moving between a strategy's components and one full-precision state dict."""

from __future__ import annotations

import torch

from .. import mcf
from . import kernels
from .base import CollageOptimizer
from .group import local as _local
from .strategies import get_strategy

__all__ = ["consolidate", "load_full_precision", "full_precision_copy"]


def _groups_by_param(optimizer: CollageOptimizer) -> dict[int, dict]:
    if not isinstance(optimizer, CollageOptimizer):
        raise TypeError("optimizer must be a collage optimizer (collage.AdamW, SGD or Lion), "
                        f"got {type(optimizer).__name__}")
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def _rewrap(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Gather a value computed on a DTensor's local shard back to a full tensor."""
    if not hasattr(like, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements,
                              shape=like.shape, stride=like.stride()).full_tensor()


@torch.no_grad()
def consolidate(model: torch.nn.Module, optimizer: CollageOptimizer) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter at full precision, as float32.

    Each parameter is the value its strategy represents (hi + lo, the master, weight plus
    compensation, the decoded split master) rounded once to float32; other floating tensors
    narrower than float32 are widened to float32, and float32 and float64 ones kept (all
    exact). Every tensor is a copy, never an alias of the model's. Keys are
    ``model.state_dict()``'s, so the result loads into a float32 copy of the model. Sharded
    (FSDP2) parameters are gathered on every rank.
    """
    groups = _groups_by_param(optimizer)
    optimizer._rederive_pending()  # weights edited since the last step: as written
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        group = groups.get(id(tensor))
        if group is None:
            out[key] = full_precision_copy(tensor)
            continue
        strategy = get_strategy(optimizer._pilot.strategy_at(
            group["strategy"], optimizer._positions[id(tensor)]))
        state = {k: _local(v) for k, v in optimizer.state.get(tensor, {}).items()}
        exact = kernels.represented_value(strategy, _local(tensor.detach()), state)
        out[key] = _rewrap(mcf.round_to(exact, torch.float32), tensor)
    return out


@torch.no_grad()
def load_full_precision(model: torch.nn.Module, optimizer: CollageOptimizer,
                        state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Set every parameter, and its compensation, from full-precision values as closely as
    the strategy holds them: exactly for ``fp32``, ``mixed`` and ``split`` (float32 values),
    within 2^-16 relative for a bf16 pair (``plus``, ``light``, ``kahan``, ``plus8``), within
    2^-8 for a lone bf16 weight (docs/strategies.md, "Interactions").

    The inverse of :func:`consolidate`: an MCF pair gets ``split(value, dtype, 2)``, a master
    gets the value, split gets the float32 value's two halves, kahan gets the rounding residue.
    Optimizer moments are created if absent and otherwise left alone. Buffers are copied.

    Every value is checked before anything is set: each parameter needs a floating-point,
    finite value of its shape; with ``strict`` (default) a key that is neither a parameter
    nor a buffer of ``model`` is an error too (``strict=False`` ignores such keys).
    """
    groups = _groups_by_param(optimizer)
    named = dict(model.named_parameters())
    _check_full_state(model, named, state_dict, strict)
    for name, param in named.items():
        value = state_dict[name]
        group = groups.get(id(param))
        if group is None:
            param.copy_(value)
            continue
        strategy = get_strategy(optimizer._pilot.strategy_at(
            group["strategy"], optimizer._positions[id(param)]))
        state = optimizer.state[param]
        if not state:
            strategy.init_state(optimizer.rule, param, state)
        local_param = _local(param)
        wide = _local_slice(value, param).to(device=local_param.device, dtype=torch.float64)
        strategy.set_from_full(local_param, {k: _local(v) for k, v in state.items()}, wide)
        optimizer._writes.note((param,))  # set with its components: not an edit (edits.py)
    for name, buffer in model.named_buffers():
        if name in state_dict:
            buffer.copy_(state_dict[name])


def full_precision_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor no optimizer component describes, as :func:`consolidate` exports it: a copy
    (never an alias), whole (a sharded one gathered), widened to float32 where its format is
    narrower (exact), float32 and float64 ones and integers kept."""
    value = tensor.detach()
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    if value.is_floating_point() and value.dtype.itemsize < 4:
        return value.to(torch.float32, copy=True)
    return value.clone()


def _check_full_state(model, named: dict, state_dict: dict, strict: bool) -> None:
    """Every value checked before anything is set (see :func:`load_full_precision`)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors (collage.consolidate's "
                        f"output), got {type(state_dict).__name__}")
    missing = [name for name in named if name not in state_dict]
    if missing:
        raise KeyError(f"state_dict has no value for parameter(s) {missing[:5]}; pass the "
                       "output of collage.consolidate or a float32 model.state_dict()")
    # the model's own state_dict keys: a tied weight under each of its names (GPT-2's
    # lm_head.weight beside transformer.wte.weight), persistent buffers
    keys = model.state_dict(keep_vars=True)
    buffers = dict(model.named_buffers())
    if strict:
        extra = sorted(set(state_dict) - set(keys) - set(named) - set(buffers))
        if extra:
            raise KeyError(f"state_dict has key(s) {extra[:5]} that are not parameters or "
                           "buffers of the model; pass strict=False to ignore them")
        absent = [name for name in keys if name in buffers and name not in state_dict]
        if absent:
            raise KeyError(f"state_dict has no value for buffer(s) {absent[:5]}; pass "
                           "strict=False to keep the model's")
    for name, param in named.items():
        _check_parameter_value(name, state_dict[name], param)
    _check_aliases(named, keys, state_dict)
    for name, buffer in buffers.items():
        if name in state_dict:
            _check_buffer_value(name, state_dict[name], buffer)


def _check_parameter_value(name: str, value, param: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"state_dict[{name!r}] is {kind}; a parameter needs a "
                        "floating-point tensor")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)} but the "
                         f"parameter has {tuple(param.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"state_dict[{name!r}] holds inf or nan; a full-precision state "
                         "must be finite")
    # finite in float64 but beyond the parameter's format: its weight would be inf
    if not bool(torch.isfinite(value.to(param.dtype)).all()):
        raise ValueError(f"state_dict[{name!r}] holds a value beyond {param.dtype}'s range "
                         f"(largest {torch.finfo(param.dtype).max:.4g}): the weight would be "
                         "inf")


def _check_aliases(named: dict, keys: dict, state_dict: dict) -> None:
    """A tied weight's other names (in ``model.state_dict()``, not in ``named``) must hold
    its value: it is set once, from its first name."""
    first = {id(param): name for name, param in named.items()}
    for key, tensor in keys.items():
        primary = first.get(id(tensor))
        if primary is None or primary == key or key not in state_dict:
            continue
        if not torch.equal(state_dict[key].to(torch.float64),
                           state_dict[primary].to(torch.float64)):
            raise ValueError(f"state_dict[{key!r}] and state_dict[{primary!r}] are one tied "
                             "parameter but hold different values")


def _check_buffer_value(name: str, value, buffer: torch.Tensor) -> None:
    """A buffer's value: a tensor of its shape, floating where it is (an integer buffer,
    such as BatchNorm's count, takes no float that would be truncated)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state_dict[{name!r}] is {type(value).__name__}; a buffer needs a "
                        "tensor")
    if tuple(value.shape) != tuple(buffer.shape):
        raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)} but the "
                         f"buffer has {tuple(buffer.shape)}")
    if value.is_floating_point() and not buffer.is_floating_point():
        raise TypeError(f"state_dict[{name!r}] is {value.dtype}; the buffer is "
                        f"{buffer.dtype} and would truncate it")


def _local_slice(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a full value that this rank's shard holds."""
    if not hasattr(param, "to_local"):
        return value.to(param.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device), param.device_mesh,
                             param.placements).to_local()
