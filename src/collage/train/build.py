"""What a run is built from: the device, the model in its strategy's dtype from shared
float32 initial weights, the parameter groups, the optimizer and its learning-rate schedule.

``collage compare`` builds the initial weights once and every strategy converts them; the
runner (:func:`collage.train.runner.train_strategy`) builds the rest per run.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..optim import AUTO, AdamW, Autopilot, get_strategy
from .config import BASELINES, Config, OptimConfig
from .data import vocab_size
from .gemm import BF16, set_mode
from .models import build_model

__all__ = [
    "initial_weights",
    "lr_factor",
    "make_optimizer",
    "param_groups",
    "prepare_model",
    "resolve_device",
    "state_checksum",
    "weight_dtype",
]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    return torch.device(name)


def weight_dtype(strategy: str) -> torch.dtype:
    """The dtype the model trains in: the strategy's default weight dtype (float32 for
    fp32, bfloat16 for the others); the baselines that are not strategies train bf16."""
    if strategy in BASELINES or strategy == AUTO:  # (auto: every rung takes bf16)
        return torch.bfloat16
    return get_strategy(strategy).weight_dtypes[0]


def initial_weights(config: Config) -> dict[str, torch.Tensor]:
    """The float32 initial state dict of ``config.model`` seeded by ``config.run.seed``."""
    model = build_model(config.model, vocab_size(config.data), seed=config.run.seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """A short hash of a state dict's names and bytes (proves identical initial weights)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def prepare_model(config: Config, strategy: str, init: dict[str, torch.Tensor],
                  device: torch.device, *, bf16_gemm: str = BF16) -> nn.Module:
    """The model with the float32 weights ``init``, converted to the strategy's dtype;
    ``bf16_gemm``: how its bf16 matrix products are computed (``collage.train.gemm``)."""
    model = build_model(config.model, vocab_size(config.data), seed=config.run.seed)
    model.load_state_dict(init)
    set_mode(model, bf16_gemm)
    return model.to(device=device, dtype=weight_dtype(strategy))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Named parameter groups: matrices and embeddings decay, biases and norm gains do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append((name, p))
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(model: nn.Module, optim: OptimConfig, strategy: str, *, beta2: float,
                   track_every: int, seed: int = 0) -> torch.optim.Optimizer:
    """collage.AdamW over named groups; ``track_every`` k measures EDQ on steps 1, k+1, ...;
    ``seed`` seeds stochastic rounding (its generator is saved in the state dict).

    ``"torchao-adamw8bit"`` is torchao's ``AdamW8bit`` on the same bf16 weights with
    ``bf16_stochastic_round=True`` (torchao's option for bf16 weights; without it every
    update is rounded to nearest into bf16, the ``bf16`` strategy's loss): the 8-bit
    baseline of ``docs/eight_bit.md``. It measures no EDQ."""
    hooked = optim.step_in_backward or optim.grad_accumulation != "plain"
    if strategy == "torchao-adamw8bit":
        if hooked:
            raise UsageError("--step-in-backward and --grad-accumulation pair are collage "
                             "optimizers' keywords: not for torchao-adamw8bit")
        from torchao.optim import AdamW8bit

        groups = [{**g, "params": [p for _, p in g["params"]]}
                  for g in param_groups(model, optim.weight_decay)]
        return AdamW8bit(groups, lr=optim.lr, betas=(optim.beta1, beta2), eps=optim.eps,
                         weight_decay=optim.weight_decay, bf16_stochastic_round=True)
    return AdamW(
        param_groups(model, optim.weight_decay), lr=optim.lr, betas=(optim.beta1, beta2),
        eps=optim.eps, weight_decay=optim.weight_decay, strategy=strategy,
        foreach=optim.foreach, track_updates=track_every or False, seed=seed,
        step_in_backward=optim.step_in_backward, grad_accumulation=optim.grad_accumulation,
        autopilot=(Autopilot(threshold=optim.auto_threshold, every=optim.auto_every)
                   if strategy == AUTO else None),
    )


def lr_factor(step: int, optim: OptimConfig, total: int) -> float:
    """Multiplier of the peak lr for 0-based ``step``: linear warm-up, then the schedule down
    to ``min_lr_ratio`` at the last step."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    span = max(total - 1 - optim.warmup_steps, 1)
    progress = min(max(step - optim.warmup_steps, 0) / span, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" \
        else 1.0 - progress
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape
