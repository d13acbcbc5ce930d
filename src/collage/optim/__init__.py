"""Precision-aware optimizers: update rule x precision strategy.

Layers, bottom up (``docs/design.md``): ``rules`` (the update) and ``strategies`` (storage
and landing); ``kernels`` (one parameter's step); ``group`` (a group's step as plain data)
and ``dispatch`` (which path runs it: ``eager``, ``compiled``, ``native``); ``functional``
(the same over lists of tensors); the classes in ``base`` and ``optimizers``.
"""

from . import functional
from .autopilot import AUTO, Autopilot
from .base import NONFINITE_POLICIES, CollageOptimizer
from .export import consolidate, load_full_precision
from .optimizers import SGD, AdamW, Lion
from .strategies import STRATEGIES, Strategy, get_strategy

__all__ = [
    "AUTO",
    "AdamW",
    "Autopilot",
    "CollageOptimizer",
    "Lion",
    "NONFINITE_POLICIES",
    "SGD",
    "STRATEGIES",
    "Strategy",
    "consolidate",
    "functional",
    "get_strategy",
    "load_full_precision",
]
