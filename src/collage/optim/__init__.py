"""Precision-aware optimizers: update rule x precision strategy."""

from .base import NONFINITE_POLICIES, CollageOptimizer
from .export import consolidate, load_full_precision
from .optimizers import SGD, AdamW, Lion
from .strategies import STRATEGIES, Strategy, get_strategy

__all__ = [
    "AdamW",
    "CollageOptimizer",
    "Lion",
    "NONFINITE_POLICIES",
    "SGD",
    "STRATEGIES",
    "Strategy",
    "consolidate",
    "get_strategy",
    "load_full_precision",
]
