"""One training step's arithmetic outside the optimizer: the token loss (of one process, or
one rank's share of the global mean), gradient clipping, and evaluation."""

from __future__ import annotations

import torch
from torch import nn

from .distributed import Ranks, all_sum
from .losses import cross_entropy
from .models import logits_of

__all__ = ["token_loss", "rank_loss", "clip_gradients", "evaluate"]


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean"
               ) -> torch.Tensor:
    """The token cross-entropy of ``model`` on ``(x, y)`` (targets -100 ignored): the
    float32 loss of the logits without a float32 copy of them (``collage.train.losses``)."""
    return cross_entropy(logits_of(model, x), y, ignore_index=-100, reduction=reduction)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> float:
    """Mean token loss over the fixed validation batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        total += float(token_loss(model, x, y, reduction="sum"))
        count += int((y != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Scale all gradients so that their global norm (computed in fp32) is at most
    ``max_norm``; returns the norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.sqrt(sum(_squared_sum(g) for g in grads)).float()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return float(norm)


#: Elements per float32 conversion in :func:`_squared_sum`: a bf16 gradient is never widened
#: whole (a float32 copy of the largest gradient would be a peak the memory model does not have).
_NORM_CHUNK = 1 << 16


def _squared_sum(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad**2)``: each range of ``_NORM_CHUNK`` elements squared and summed in float32,
    the range sums added in float64."""
    flat = grad.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for part in flat.split(_NORM_CHUNK):
        total += part.float().pow(2).sum()
    return total


def rank_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """This rank's share of the global mean token loss, scaled for DDP's gradient average.

    DDP averages gradients over ranks, so the rank loss is ``sum_rank * world / count``
    with ``count`` the global number of targets: the average is then the gradient of the
    global mean, whatever each rank's share of the targets. The global mean itself (for
    the history) is attached as ``.global_mean``.
    """
    total = token_loss(net, x, y, reduction="sum")
    count = all_sum((y != -100).sum(), ranks).clamp(min=1)
    loss = total * (ranks.world_size / count)
    loss.global_mean = all_sum(total.detach(), ranks) / count
    return loss
