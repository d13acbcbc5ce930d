"""Cross-entropy for low-precision logits that keeps no float32 copy of them.

``F.cross_entropy(logits.float(), target)``, the usual loss of a bf16 model, keeps the
float32 log-softmax of the logits for backward (4 bytes per logit, twice the bf16 logits)
and builds two more float32 tensors of that size at the start of backward (the gradient of
the log-softmax's output and of its input) before casting the result back to bf16. Those
are the largest tensors of the step for a large vocabulary, and they sit at the step's
memory peak: the start of backward, where every activation is still held.

:func:`cross_entropy` computes the same loss in float32 (float64 for float64 logits) but
keeps only the logits themselves (which the caller usually holds anyway) and one float32
log-sum-exp per row. Backward recomputes the softmax in float32 in chunks of rows and
writes the gradient straight into a tensor of the logits' dtype: at most one float32 chunk
(``chunk_elements`` logits) exists at a time.

Accuracy: the loss and the float32 gradient are those of the float32 formula up to float32
rounding (a few ulps: ``lse - x[target]`` instead of ``-(x[target] - max - log(sum))``);
the gradient is rounded once to the logits' dtype, as autograd's ``.float()`` backward
does. ``tests/train/test_losses.py`` checks both against float64.
"""

from __future__ import annotations

import torch

__all__ = ["cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")
DEFAULT_CHUNK_ELEMENTS = 1 << 20  # 4 MiB of float32 per chunk


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean",
                  chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., V)``, any float dtype) against class indices
    ``target`` (``(...)``, integer), like ``F.cross_entropy(logits.float().reshape(-1, V),
    target.reshape(-1), ignore_index=..., reduction=...)``: targets equal to
    ``ignore_index`` add nothing, ``mean`` divides by the number of the others (nan when
    there are none, as torch does). ``reduction="none"`` returns the per-target losses in
    ``target``'s shape. The gradient has the logits' dtype."""
    _check(logits, target, reduction, chunk_elements)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    # class indices of a narrower integer type (uint8, int16: the byte corpus's tokens)
    # widened, exactly, to the int64 that gather takes (they crashed inside gather)
    flat_target = target.reshape(-1).long()
    loss = _LeanCrossEntropy.apply(flat_logits, flat_target, ignore_index, reduction,
                                   max(1, chunk_elements // max(1, logits.shape[-1])))
    return loss.reshape(target.shape) if reduction == "none" else loss


def _check(logits: torch.Tensor, target: torch.Tensor, reduction: str,
           chunk_elements: int) -> None:
    if not logits.is_floating_point():
        raise TypeError(f"cross_entropy: logits must be a floating tensor, got {logits.dtype}")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise TypeError("cross_entropy: target must hold integer class indices, got "
                        f"{target.dtype} (probabilities as targets are not supported)")
    if logits.ndim < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} must be target's shape "
                         f"{tuple(target.shape)} plus a class dimension")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction={reduction!r}; valid: "
                         + ", ".join(REDUCTIONS))
    if chunk_elements < 1:
        raise ValueError(f"cross_entropy: chunk_elements={chunk_elements} must be >= 1")


def _check_targets(target: torch.Tensor, valid: torch.Tensor, classes: int,
                   ignore_index: int) -> None:
    """Out-of-range class indices are an error (as in torch), named. Checked on the CPU
    only: on an accelerator the check would wait for the device every step; there, gather's
    own bounds check catches them."""
    if target.device.type != "cpu" or target.numel() == 0:
        return
    bad = valid & ((target < 0) | (target >= classes))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(f"cross_entropy: target holds {value}, outside the {classes} classes "
                         f"[0, {classes}) (and not ignore_index={ignore_index})")


class _LeanCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, chunk_rows):
        compute = torch.promote_types(logits.dtype, torch.float32)
        valid = target != ignore_index
        _check_targets(target, valid, logits.shape[-1], ignore_index)
        safe = torch.where(valid, target, torch.zeros_like(target))
        lse = torch.empty(logits.shape[0], dtype=compute, device=logits.device)
        for rows in _chunks(logits.shape[0], chunk_rows):
            lse[rows] = _logsumexp_rows(logits[rows], compute)
        picked = logits.gather(1, safe[:, None]).squeeze(1).to(compute)
        losses = torch.where(valid, lse - picked, torch.zeros_like(lse))
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.reduction, ctx.chunk_rows = reduction, chunk_rows
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / valid.sum() if reduction == "mean" else total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        logits, safe, valid, lse = ctx.saved_tensors
        scale = _row_scale(ctx.reduction, grad_loss.to(lse.dtype), valid)
        grad = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], ctx.chunk_rows):
            # d loss_i / d x_ij = softmax(x_i)_j - [j == target_i], times the row's scale
            part = logits[rows].to(lse.dtype, copy=True).sub_(lse[rows, None]).exp_()
            part.scatter_add_(1, safe[rows, None],
                              torch.full_like(part[:, :1], -1.0))
            grad[rows] = part.mul_(scale[rows, None])
        return grad, None, None, None, None


def _logsumexp_rows(chunk: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """log(sum(exp(x))) of each row, in ``compute``, with one temporary of the chunk's size
    (``torch.logsumexp`` of a converted chunk holds two): the row's maximum is subtracted
    first (no overflow), except where it is infinite (a row of -inf gives -inf, one with
    +inf gives +inf or nan, as torch.logsumexp does)."""
    part = chunk.to(compute, copy=True)  # never writes the caller's logits
    top = part.amax(dim=1, keepdim=True)
    top = torch.where(top.isinf(), torch.zeros_like(top), top)
    return part.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))


def _row_scale(reduction: str, grad_loss: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's factor in the gradient: the upstream gradient (divided by the count of
    valid targets for ``mean``), zero on ignored rows."""
    if reduction == "none":
        return torch.where(valid, grad_loss, torch.zeros_like(grad_loss))
    per_row = grad_loss / valid.sum() if reduction == "mean" else grad_loss
    return torch.where(valid, per_row, torch.zeros_like(per_row))


def _chunks(count: int, size: int):
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))
