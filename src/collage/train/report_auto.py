"""The autopilot (``strategy="auto"``, ``docs/autopilot.md``) in the harness: what a run
records of it, the report's section (which tensors were promoted, per module family, and
when; bytes per parameter at the end and at the peak) and the plot of bytes per parameter
over training (``auto_bytes.png``)."""

from __future__ import annotations

import math
from typing import Any

from ..metrics import module_family
from ..optim.autopilot import AUTO

__all__ = ["AUTO", "record_auto", "promoted", "auto_summary", "auto_section",
           "plot_auto_bytes"]


def record_auto(history: dict[str, Any], stats: dict[str, float], step: int) -> None:
    """Append a measured step's bytes per parameter (the autopilot's steps only)."""
    value = stats.get("auto/bytes_per_param")
    if value is not None:
        history.setdefault("auto_step", []).append(step)
        history.setdefault("auto_bytes_per_param", []).append(value)


def promoted(optimizer, stats_before) -> bool:
    """Whether the step just made promoted a tensor (its measured stats say so)."""
    stats = getattr(optimizer, "update_stats", None)
    return stats is not stats_before and bool(stats) and bool(stats.get("auto/promoted"))


def auto_summary(optimizer, history: dict[str, Any]) -> dict[str, Any]:
    """What a run's summary keeps of the autopilot ({} for other strategies): every
    promotion, and bytes per parameter at the end and at the peak (the same at the end:
    promotions only)."""
    pilot = getattr(optimizer, "_pilot", None)
    if pilot is None or not any(g["strategy"] == AUTO for g in optimizer.param_groups):
        return {}
    final = pilot.bytes_per_param(optimizer)
    seen = [*history.get("auto_bytes_per_param", ()), final]
    return {"auto_decisions": [d._asdict() for d in optimizer.autopilot_decisions],
            "auto_bytes_per_param_final": final,
            "auto_bytes_per_param_peak": max(seen)}


def auto_section(records: list[dict[str, Any]]) -> list[str]:
    """The report's section on the ``auto`` runs: per run (seed), bytes per parameter
    and, per module family, the tensors promoted to each rung and the steps it happened
    at (1-based: the step after which the promotion took effect)."""
    runs = [(r, seed) for r in records if r["strategy"] == AUTO
            for seed in (r.get("per_seed") or [r])]
    if not runs:
        return []
    lines = ["## Autopilot: what was promoted, and when", "",
             "| β2 | seed | B/param at the end (peak) | family: tensors promoted (to which "
             "rung) at steps |", "|---|---|---|---|"]
    for record, run in runs:
        per_family: dict[str, list[str]] = {}
        for d in run.get("auto_decisions") or ():
            per_family.setdefault(module_family(d["name"]), []).append(
                f"{d['new']}@{d['step'] + 1}")
        cells = "; ".join(f"{family}: {len(moves)} ({_moves(moves)})"
                          for family, moves in sorted(per_family.items())) or "none"
        final, peak = run.get("auto_bytes_per_param_final"), run.get("auto_bytes_per_param_peak")
        lines.append(f"| {record['beta2']:g} | {run.get('seed', '-')} | {_num(final)} "
                     f"({_num(peak)}) | {cells} |")
    return lines + ["", "*B/param*: weights, gradient, optimizer states and compensation "
                    "of every tensor at its rung (`collage memory`'s count); promotions "
                    "only, so the peak is the end. Each entry is `rung@step`, grouped by "
                    "module family.", ""]


def _moves(moves: list[str]) -> str:
    """``light@1 x3, plus@200``: the same rung and step counted once."""
    counts: dict[str, int] = {}
    for move in moves:
        counts[move] = counts.get(move, 0) + 1
    return ", ".join(m if n == 1 else f"{m} x{n}" for m, n in counts.items())


def _num(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def plot_auto_bytes(plt, lines: list, style, out_dir: str, save) -> str | None:
    """Bytes per parameter over training of each ``auto`` line (one curve per seed)."""
    auto = [line for line in lines if line.strategy == AUTO
            and any(h.get("auto_step") for h in line.histories)]
    if not auto:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for line in auto:
        for i, h in enumerate(line.histories):
            ax.step(h["auto_step"], h["auto_bytes_per_param"], where="post",
                    **{**style(line), "label": line.label if i == 0 else None})
    ax.set(title="autopilot: bytes per parameter over training", xlabel="step",
           ylabel="bytes / param")
    ax.legend(fontsize=8)
    return save(plt, fig, out_dir, "auto_bytes.png")
