"""Fused multiply-adds whose coefficient may be a Python number (the eager paths) or a 0-d
tensor (the compiled paths, where a new value must be data, not a recompilation): both
round once, as torch's ``add(x, alpha=a)`` does on CPU (a fused multiply-add), so eager and
compiled compute the same bits."""

from __future__ import annotations

import torch

__all__ = ["axpy", "axpy_"]


def axpy(base: torch.Tensor, x: torch.Tensor, alpha) -> torch.Tensor:
    """``base + x * alpha`` with one rounding; ``alpha`` None means 1."""
    if alpha is None:
        return base + x
    if isinstance(alpha, torch.Tensor):  # addcmul(b, x, a) is fma(1 * x, a, b)
        return torch.addcmul(base, x, alpha.to(base.dtype))
    return torch.add(base, x, alpha=alpha)


def axpy_(base: torch.Tensor, x: torch.Tensor, alpha) -> torch.Tensor:
    """``base += x * alpha`` in place, with one rounding."""
    if isinstance(alpha, torch.Tensor):
        return base.addcmul_(x, alpha.to(base.dtype))
    return base.add_(x, alpha=alpha)
