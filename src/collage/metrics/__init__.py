"""Update-quality metrics (how much of each intended update reached the weights) and sinks.

``edq`` and ``imprecision`` work on any tensors; :class:`UpdateStats` accumulates them per key
on device, reduces them across ranks with one ``all_reduce`` and reports a flat dict with one
host sync; the sinks write such dicts to CSV, JSON lines or TensorBoard. Definitions and how
to read the numbers: ``docs/metrics.md``.
"""

from .sinks import CSVWriter, JSONLinesWriter, MetricsCallback, TensorBoardWriter
from .stats import (
    FAMILIES,
    FIELDS,
    UpdateStats,
    component_change,
    edq,
    imprecision,
    module_family,
    update_sums,
    update_sums_blocked,
)

__all__ = [
    "component_change",
    "update_sums",
    "update_sums_blocked",
    "CSVWriter",
    "FAMILIES",
    "FIELDS",
    "JSONLinesWriter",
    "MetricsCallback",
    "TensorBoardWriter",
    "UpdateStats",
    "edq",
    "imprecision",
    "module_family",
]
