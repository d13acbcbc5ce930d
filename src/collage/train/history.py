"""The history of a training run (losses, learning rate, measured EDQ per step and per
module family) and the means its summary reports."""

from __future__ import annotations

import math
from typing import Any

from ..metrics import FAMILIES, module_family
from .report_auto import record_auto

__all__ = ["STAT_KEYS", "new_history", "family_stats", "record_stats", "mean", "tail_mean",
           "family_means"]

STAT_KEYS = ("edq", "imprecision", "edq_visible", "imprecision_visible")


def new_history() -> dict[str, Any]:
    """An empty history: one list per recorded quantity, measured ones per family."""
    return {
        "step": [], "train_loss": [], "lr": [], "grad_norm": [],
        "val_step": [], "val_loss": [],
        "stats_step": [], **{k: [] for k in STAT_KEYS}, "family": {f: {} for f in FAMILIES},
    }


def family_stats(stats: dict[str, float], names: list[tuple[str, int]]
                 ) -> dict[str, dict[str, float]]:
    """EDQ and imprecision per module family, from the per-parameter entries of
    ``optimizer.update_stats``.

    Exact roll-up from the per-name ratios: ``<e,d> = edq * ||d||^2`` and
    ``||d||^2 = update_norm^2`` are summed per family, so the family EDQ is
    ``sum <e,d> / sum ||d||^2``, the same as measuring the family as one tensor. Imprecision
    is a fraction of elements; it is averaged weighted by each parameter's number of
    elements (equal to the exact roll-up when every element has a non-zero intended update,
    the usual case for AdamW).
    """
    sums: dict[str, list[float]] = {}
    for name, numel in names:
        family = module_family(name)
        edq, norm = stats.get(f"edq/{name}"), stats.get(f"update_norm/{name}")
        if edq is None or norm is None or not math.isfinite(edq):
            continue
        s = sums.setdefault(family, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        dd = norm * norm
        s[0] += edq * dd
        s[1] += dd
        for i, key in ((2, "imprecision"), (4, "imprecision_visible")):
            value = stats.get(f"{key}/{name}")
            if value is not None and math.isfinite(value):
                s[i] += value * numel
                s[i + 1] += numel
    out = {}
    for family, s in sums.items():
        out[family] = {
            "edq": s[0] / s[1] if s[1] else math.nan,
            "imprecision": s[2] / s[3] if s[3] else math.nan,
            "imprecision_visible": s[4] / s[5] if s[5] else math.nan,
        }
    return out


def record_stats(history: dict[str, Any], stats: dict[str, float] | None, step: int,
                 names: list[tuple[str, int]]) -> None:
    """Append a measured step's whole-model and per-family statistics."""
    if not stats:
        return
    history["stats_step"].append(step)
    record_auto(history, stats, step)
    for k in STAT_KEYS:
        history[k].append(stats.get(k, math.nan))
    per_family = family_stats(stats, names)
    for family in FAMILIES:
        entry = history["family"][family]
        for k in ("edq", "imprecision", "imprecision_visible"):
            entry.setdefault(k, []).append(per_family.get(family, {}).get(k, math.nan))


def mean(values: list[float]) -> float:
    """The mean of the finite values (nan when there is none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def tail_mean(values: list[float], fraction: float = 0.05) -> float:
    """Mean of the last ``fraction`` of the values (at least one): a less noisy final loss."""
    if not values:
        return math.nan
    n = max(1, int(len(values) * fraction))
    return sum(values[-n:]) / n


def family_means(history: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each measured family's mean EDQ and imprecision over the run."""
    return {f: {k: mean(v) for k, v in history["family"][f].items()}
            for f in FAMILIES if history["family"][f]}
