"""Helpers for using collage optimizers with training frameworks.

Nothing here imports a framework at module import time; ``transformers`` is imported only by
the function that reads a ``TrainingArguments``. ``docs/integrations.md`` shows each
framework (Hugging Face ``Trainer``, Accelerate, Lightning, ``torch.compile``) end to end.

* :func:`param_groups` splits a model's trainable parameters into a weight-decay group and a
  no-decay group (norms and biases) the way ``transformers.Trainer`` does, optionally with
  another precision strategy for the no-decay group.
* :func:`decay_parameter_names` is the rule on its own (the names that get weight decay).
* :func:`adamw_for_trainer` builds ``collage.AdamW`` from a ``TrainingArguments`` (learning
  rate, betas, epsilon, weight decay) for ``Trainer(optimizers=(optimizer, None))`` and
  refuses settings that would fight a low-precision strategy (``fp16=True`` on bf16
  weights).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .optim import AdamW, get_strategy
from .optim.strategies import DEFAULT_STRATEGY

__all__ = [
    "NO_DECAY_PATTERNS",
    "adamw_for_trainer",
    "decay_parameter_names",
    "norm_module_types",
    "param_groups",
]

#: Parameter-name patterns excluded from weight decay: ``transformers.Trainer``'s
#: (``re.search`` on the lower-cased full name). Covers ``bias``, ``LayerNorm``/``layernorm``,
#: ``RMSNorm``, ``norm`` as a module name (``model.norm.weight``), ``*_norm`` (``q_norm``).
NO_DECAY_PATTERNS: tuple[str, ...] = (
    r"bias",
    r"layernorm",
    r"rmsnorm",
    r"(?:^|\.)norm(?:$|\.)",
    r"_norm(?:$|\.)",
)


def norm_module_types() -> tuple[type[nn.Module], ...]:
    """The normalization layers whose parameters never get weight decay.

    ``transformers`` uses ``nn.LayerNorm`` (``ALL_LAYERNORM_LAYERS``) and relies on the name
    patterns for the rest; we also include ``nn.RMSNorm`` (torch >= 2.4), ``nn.GroupNorm``
    and the batch/instance norms, whose weights are scales just the same.
    """
    types: list[type[nn.Module]] = [nn.LayerNorm, nn.GroupNorm,
                                    nn.modules.batchnorm._NormBase]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return tuple(types)


def _compile(patterns: str | Iterable[str]) -> list[re.Pattern]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"no_decay patterns must be strings, got {type(pattern).__name__}")
        compiled.append(re.compile(pattern, re.IGNORECASE))
    return compiled


def _owner(model: nn.Module, name: str) -> nn.Module:
    """The module that registers parameter ``name`` directly."""
    prefix = name.rpartition(".")[0]
    return model.get_submodule(prefix) if prefix else model


def decay_parameter_names(
    model: nn.Module,
    no_decay: str | Iterable[str] = NO_DECAY_PATTERNS,
    norm_types: Sequence[type[nn.Module]] | None = None,
) -> list[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters that get weight
    decay: every parameter except those registered directly by a normalization layer
    (``norm_types``, default :func:`norm_module_types`) and those whose full name matches a
    ``no_decay`` pattern (regular expressions, ``re.search``, case-insensitive; a plain
    substring such as ``"bias"`` or ``"LayerNorm.weight"`` works as one).

    With the defaults this selects the same names as ``Trainer.get_decay_parameter_names``
    for ``transformers`` models (tested on GPT-2, LLaMA and BERT configurations).
    """
    patterns = _compile(no_decay)
    types = tuple(norm_module_types() if norm_types is None else norm_types)
    names = []
    for name, _ in model.named_parameters():
        if types and isinstance(_owner(model, name), types):
            continue
        if any(p.search(name) for p in patterns):
            continue
        names.append(name)
    return names


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.01,
    *,
    no_decay: str | Iterable[str] = NO_DECAY_PATTERNS,
    norm_types: Sequence[type[nn.Module]] | None = None,
    no_decay_strategy: str | None = None,
    named: bool = True,
) -> list[dict[str, Any]]:
    """Param groups for a collage optimizer: weight decay for matrices, none for norms and
    biases, as ``transformers.Trainer`` builds them.

    Returns up to two groups (an empty one is left out), over the trainable parameters only
    (``requires_grad``), in ``model.named_parameters()`` order; a tied parameter appears
    once, under its first name::

        optimizer = collage.AdamW(param_groups(model, 0.1), lr=3e-4, strategy="plus")

    ``weight_decay`` goes to the first group, 0.0 to the second. ``no_decay`` and
    ``norm_types`` are as in :func:`decay_parameter_names`. ``no_decay_strategy``, if given,
    sets the ``strategy`` of the no-decay group (for example ``"mixed"``: float32 masters
    for the few, small norm and bias tensors while the matrices use ``"plus"``); the group
    without it uses the optimizer's ``strategy``. With ``named=True`` (default) the groups
    hold ``(name, parameter)`` pairs, so that torch keeps ``param_names``: errors and
    ``track_updates`` metrics then name each parameter.
    """
    if no_decay_strategy is not None:
        get_strategy(no_decay_strategy)  # a clear error now rather than at construction
    decay_names = set(decay_parameter_names(model, no_decay, norm_types))
    decay: list = []
    other: list = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        item = (name, param) if named else param
        (decay if name in decay_names else other).append(item)
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(weight_decay)})
    if other:
        group: dict[str, Any] = {"params": other, "weight_decay": 0.0}
        if no_decay_strategy is not None:
            group["strategy"] = no_decay_strategy
        groups.append(group)
    if not groups:
        raise ValueError("the model has no trainable parameters (none with requires_grad)")
    return groups


def adamw_for_trainer(model: nn.Module, args: Any, *, strategy: str = DEFAULT_STRATEGY,
                      no_decay_strategy: str | None = None, **kwargs: Any):
    """``collage.AdamW`` configured from a ``transformers.TrainingArguments``, for
    ``Trainer(model, args, ..., optimizers=(optimizer, None))``.

    Uses ``args.learning_rate``, ``args.adam_beta1``/``adam_beta2``, ``args.adam_epsilon``
    and ``args.weight_decay`` with :func:`param_groups` (no decay for norms and biases), as
    ``Trainer.create_optimizer`` does for its own AdamW; ``kwargs`` go to ``collage.AdamW``
    (``track_updates``, ``seed``, ...). ``Trainer`` then builds its learning-rate scheduler
    on this optimizer and saves/restores ``optimizer.state_dict()`` in checkpoints, state
    dtypes included.

    The model must already have the strategy's weights (``model.to(torch.bfloat16)`` for
    every strategy but ``fp32``). ``args.fp16=True`` is refused for bf16 weights (it would
    add float16 autocast and a GradScaler to a bf16 model); ``args.bf16=True`` only adds
    bf16 autocast, which changes nothing for a bf16 model, so keep it False (see
    ``docs/integrations.md``).
    """
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if getattr(args, "fp16", False) and torch.bfloat16 in dtypes:
        raise ValueError("TrainingArguments(fp16=True) with bfloat16 weights: float16 autocast "
                         "and loss scaling do not apply to a pure-bf16 model; set fp16=False "
                         "(and bf16=False) and convert the model with model.to(torch.bfloat16)")
    if getattr(args, "bf16", False) and dtypes == {torch.bfloat16}:
        warnings.warn("TrainingArguments(bf16=True) only adds bf16 autocast, which a bf16 "
                      "model does not need; bf16=False is equivalent and cheaper",
                      UserWarning, stacklevel=2)
    groups = param_groups(model, args.weight_decay, no_decay_strategy=no_decay_strategy)
    return AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                 eps=args.adam_epsilon, weight_decay=args.weight_decay, strategy=strategy,
                 **kwargs)
