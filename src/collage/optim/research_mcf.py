"""The research code's MCF operations, written with PyTorch operations on tensors of the
component dtype (the reference path, ``reference=True``; ``docs/research_plus.md``).

Each PyTorch operation on bf16 tensors computes in float32 and rounds once to bf16, so these
are *not* ``collage.mcf``'s error-free transformations (which round each elementary
operation once, from an exact float64 value): they are what the published Collage code
(amazon-science/collage, ``roBERTa/utils/monitor_metrics.py``) computes, step for step.
Three defects of its Collage-plus second moment are fixed here, and only here:

1. :func:`split_beta`: ``beta`` is split against its rounding to the component dtype
   (``bf16(0.999) = 1.0`` and residual ``-0.001``), where the research code subtracts its
   float32 rounding (a residual of about ``-1.3e-8``: the moment never decays).
2. :func:`scale_pair`: the product's rounding error is computed from the original ``hi``,
   before it is overwritten (the research code's ``MultMC_`` multiplies in place and then
   forms the "error" from the product and itself).
3. :func:`scale_pair`: the renormalisation subtracts ``(new_hi - product)`` with the product
   kept in its own tensor (the research code's ``result_m`` is the same tensor as ``hi``
   there, so nothing is subtracted and the low part is counted twice).

One rule is added: ``collage.mcf``'s non-finite rule (:func:`_nonfinite_rule`). Where a sum
overflows, the research operations turn the pair into ``(nan, -inf)``; here it becomes
``(inf, 0)``, so that an overflow is reported as such. Finite values are untouched.
"""

from __future__ import annotations

import torch

__all__ = ["grow", "split_beta", "scale_pair", "add_to_pair"]


def grow(hi: torch.Tensor, lo: torch.Tensor, value: torch.Tensor) -> None:
    """``(hi, lo) += value`` in place, as the research code's ``Grow_Exp_`` (the weight's
    landing under Collage-light and -plus): a TwoSum-like correction with every operation
    a rounded PyTorch operation."""
    total = hi + value
    lo.add_(value - (total - hi))
    hi.copy_(total + lo)
    lo.sub_(hi - total)
    _nonfinite_rule(hi, lo, total)


def split_beta(beta: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta`` as ``(beta_hi, beta_lo)`` 0-d tensors of ``like``'s dtype: ``beta_hi`` its
    rounding (through float32, as ``torch.tensor(beta).to(like)`` rounds), ``beta_lo`` the
    rest, ``beta - beta_hi``, rounded the same way. Defect 1 fixed: the research code took
    the rest against float32's rounding of beta. Computed on the host (the same roundings
    on every device), so that nothing is read back from ``like``'s device (a meta tensor
    has no values; a CUDA one would wait)."""
    beta_hi = torch.tensor(beta).to(like.dtype)
    beta_lo = torch.tensor(beta - beta_hi.item()).to(like.dtype)
    return beta_hi.to(like.device), beta_lo.to(like.device)


def scale_pair(hi: torch.Tensor, lo: torch.Tensor, beta_hi: torch.Tensor,
               beta_lo: torch.Tensor) -> None:
    """``(hi, lo) *= (beta_hi + beta_lo)`` in place: the research code's ``MultMC_`` with its
    aliasing fixed (defects 2 and 3): the product and its error are formed from the
    original ``hi``, and the product is kept apart until the pair is renormalised."""
    product = hi * beta_hi
    # hi * beta_hi is exact in float32 (8 x 8 significant bits) and the product is its
    # rounding: the difference is the exact rounding error, which fits in bf16
    error = torch.addcmul(-product, hi, beta_hi)
    lo.mul_(beta_hi).addcmul_(hi, beta_lo).add_(error)
    total = product + lo
    lo.sub_(total - product)
    hi.copy_(total)
    _nonfinite_rule(hi, lo, product)


def add_to_pair(hi: torch.Tensor, lo: torch.Tensor, value: torch.Tensor) -> None:
    """``(hi, lo) += value`` in place, as the research code's ``Grow_Exp_addcmul_`` (the
    slow EMA's increment under Collage-plus); ``value`` is a fresh tensor, consumed."""
    total = hi + value
    value.add_(hi - total).add_(lo)
    hi.copy_(total + value)
    lo.copy_(value - (hi - total))
    _nonfinite_rule(hi, lo, total)


def _nonfinite_rule(hi: torch.Tensor, lo: torch.Tensor, total: torch.Tensor) -> None:
    """Where the rounded sum ``total`` is inf or nan the pair is ``(total, 0)``, and where
    ``hi`` is not finite ``lo`` is 0 (``collage.mcf``'s rule: a trailing component is +0
    where its leading one is not finite)."""
    hi.copy_(torch.where(torch.isfinite(total), hi, total))
    lo.masked_fill_(~torch.isfinite(hi), 0.0)
