"""Per-block power-of-two scales: fit a tensor into a narrow format's range, exactly.

A float8 component covers a small range (``float8_e4m3fn``: 2**-9 to 448). Dividing a
block of ``block`` consecutive elements (of the flattened tensor) by a power of two ``s``
moves the block's largest finite magnitude into the binade ``[2**top, 2**(top + 1))`` and
changes nothing else: scaling by a power of two is exact in binary floating point as long
as the result neither overflows nor falls below the smallest normal number, so every MCF
identity (``hi + lo == a + b``, ``hi == fl(hi + lo)``) holds for ``x / s`` exactly when it
holds for ``x``, and multiplying back by ``s`` restores it bit for bit.

Rules: a block whose elements are all zero or non-finite has ``s = 1``; non-finite elements
are ignored when choosing ``s`` (they stay non-finite); the exponent of ``s`` is clamped to
float32's normal range ``[-126, 127]``.

:func:`block_scales` works on float32 with integer bit operations (no ``frexp``), so that it
compiles inside the fused optimizer kernels; :func:`block_scales_reference` is its float64
definition (``frexp``), used by the reference path and the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["block_scales", "block_scales_reference", "expand_scales", "exponent32", "pow2_32"]


def exponent32(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(|x|))`` of float32 ``x`` as int32, read from the exponent field::

        float32 bits: s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm  ->  eeeeeeee - 127

    Exact for normal numbers; -127 for zero and float32 subnormals (callers clamp)."""
    return ((x.view(torch.int32) >> 23) & 0xFF) - 127


def pow2_32(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` as float32 for int32 ``e`` in ``[-126, 127]`` (built from its bits)."""
    return ((e + 127) << 23).view(torch.float32)


def _padded_absmax(mag: torch.Tensor, block: int) -> torch.Tensor:
    n = mag.numel()
    blocks = (n + block - 1) // block
    return F.pad(mag, (0, blocks * block - n)).view(blocks, block).amax(1)


def block_scales(x: torch.Tensor, block: int, top: int) -> torch.Tensor:
    """float32 powers of two, one per block of the flattened float32 ``x``, with
    ``2**top <= max|x_block| / s < 2**(top + 1)`` for every block holding a normal number."""
    if x.dtype != torch.float32:  # (exponent32 reads the float32 bit pattern)
        raise TypeError(f"block_scales: x must be float32, got {x.dtype}; convert it first "
                        "(x.float(): exact from bf16 and fp16)")
    mag = x.reshape(-1).abs()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
    amax = _padded_absmax(mag, block)
    e = torch.where(amax > 0, exponent32(amax) - top, torch.zeros_like(amax, dtype=torch.int32))
    return pow2_32(e.clamp(-126, 127))


def block_scales_reference(x: torch.Tensor, block: int, top: int) -> torch.Tensor:
    """:func:`block_scales` from its definition, in float64 (``frexp``); returns float64."""
    mag = x.reshape(-1).double().abs()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
    amax = _padded_absmax(mag, block)
    _, e = torch.frexp(amax)  # amax = m * 2**e with 0.5 <= m < 1: floor(log2 amax) = e - 1
    e = torch.where(amax > 0, e.double() - 1 - top, torch.zeros_like(amax))
    return torch.exp2(e.clamp(-126, 127))


def expand_scales(scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The per-element scale of a flattened tensor of ``n`` elements.

    Written as expand + slice, not ``scales[arange(n) // block]``: inductor (torch 2.14,
    dynamic shapes, CPU) miscompiles that gather for the elements of a last, partial block.
    """
    return scales.view(-1, 1).expand(scales.numel(), block).reshape(-1)[:n]
