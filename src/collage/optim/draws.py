"""Counter-based uniform draws for stochastic rounding (``stochastic``, ``plus8``).

Every path (reference, per-tensor, foreach, compiled, native) draws the same numbers: the
draw for element ``i`` of a parameter at a step is a pure function of (the optimizer's
``seed``, the parameter's position in the optimizer, the step, ``i``), where ``i`` is the
element's index in the *whole* flattened tensor. So the draws depend neither on sharding
nor on generator state: DDP ranks agree, an FSDP2 shard draws what one process draws for
those elements, and a resume needs only the per-parameter ``step``.

A key is mixed from (seed, position, step) by splitmix64 rounds on the host
(:func:`stochastic_key`); inside a kernel, two rounds of a 32-bit integer hash of
``index ^ key`` give 24 random bits (:func:`counter_uniform`), computed in registers: no
draw tensor is written and read back in the compiled, native and Triton kernels.
"""

from __future__ import annotations

import torch

__all__ = ["MIX_START", "mix_state", "mix", "stochastic_key", "draw_key", "counter_uniform",
           "uniforms", "flat_offset", "local_uniform"]

_MASK64 = (1 << 64) - 1
MIX_START = 0x9E3779B97F4A7C15


def mix_state(h: int, *values: int) -> int:
    """The 64-bit state of :func:`mix` after mixing ``values`` into state ``h``: a state
    kept after some values continues with the rest (native plans mix the step in C,
    ``collage_stochastic_keys``)."""
    for value in values:
        h = ((h ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): the same in every process and run."""
    return mix_state(MIX_START, *values) & ((1 << 63) - 1)


def stochastic_key(seed: int, position: int, step: int) -> tuple[int, int]:
    """The two int32 key words of a parameter's draws at ``step``, as Python ints."""
    key = mix(seed, position, step)
    return (key & 0xFFFFFFFF) - (1 << 31), (key >> 32) & 0x7FFFFFFF


def draw_key(seed: int, position: int, step: int, first_index: int,
             device: torch.device) -> torch.Tensor:
    """The int32 ``[key0, key1, first element index]`` that the kernels take: the draws of
    elements ``first_index, first_index + 1, ...`` of the parameter at ``position``."""
    words = [*stochastic_key(seed, position, step), first_index]
    return torch.tensor(words, dtype=torch.int32, device=device)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons) on int32 with wrapping multiplies;
    ``& mask`` after each shift makes the arithmetic shifts logical."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))
    return x ^ ((x >> 16) & 0xFFFF)


def counter_uniform(n: int, key: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """``n`` float32 uniforms in [0, 1) on a 2**-24 grid (like ``torch.rand``) for element
    indices ``key[2] + 0..n-1``, keyed by the int32 ``key[0]``, ``key[1]``: two rounds of a
    32-bit hash. A nonzero int32 ``salt`` gives an independent stream from the same key
    (``plus8`` rounds two states per element).

    Pure function of (index, key): eager and compiled give the same bits, and inside a
    compiled kernel nothing is stored (the hash is computed in registers).
    """
    index = torch.arange(n, dtype=torch.int32, device=key.device) + key[2]
    h = _mix32(index ^ (key[0] ^ salt) if salt else index ^ key[0])
    h = _mix32(h ^ key[1])
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (2.0**-24)


def uniforms(draws: torch.Tensor, n: int, salt: int = 0) -> torch.Tensor:
    """The ``n`` uniforms of ``draws``: a key (int32, :func:`draw_key`) hashed by
    :func:`counter_uniform`, or float32 uniforms already drawn (a shard that is not one
    flat range of its parameter, :func:`local_uniform`)."""
    if draws.dtype == torch.int32:
        return counter_uniform(n, draws, salt)
    if salt:
        raise ValueError("a salted stream needs a draw key, not drawn uniforms")
    return draws.reshape(-1)


def flat_offset(param: torch.Tensor, local: torch.Tensor) -> int | None:
    """Index of ``local``'s first element in the flattened whole ``param``, when the local
    tensor is one contiguous range of it (plain tensors; DTensors sharded on dim 0 only);
    None otherwise."""
    if not hasattr(param, "device_mesh"):
        return 0
    try:
        shape, offset = _local_box(param)
    except Exception:  # pragma: no cover - other DTensor layouts
        return None
    if tuple(shape[1:]) != tuple(param.shape[1:]):
        return None  # sharded on an inner dimension: not one flat range
    inner = 1
    for size in param.shape[1:]:
        inner *= size
    return int(offset[0]) * inner if len(offset) else 0


def local_uniform(param: torch.Tensor, local: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The draws of ``local``'s elements (any shard layout): the whole tensor's draws
    (``key[2]`` = 0), cut to this rank's box. For shards that are not one flat range."""
    whole = counter_uniform(param.numel(), key).view(param.shape)
    shape, offset = _local_box(param)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()


def _local_box(param):
    """(local shape, global offset) of this rank's shard of a DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                 param.placements)
