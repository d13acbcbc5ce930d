"""The plots of ``collage compare`` (matplotlib, Agg backend): ``loss.png``, ``edq.png``,
``memory.png`` and, over several seeds, ``pareto.png``.

A line is one setting (strategy, beta2, learning rate): the mean over its seeds, with the
95 % Student t band of that mean shaded when there are several (one seed: the run itself,
as before seeds existed). With several learning rates each strategy is drawn at its best
one only (the others are in the report's table).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from .aggregate import pareto_front
from .config import Config
from .memory import ROLES
from .report_auto import plot_auto_bytes
from .runs import Run
from .stats import t_critical

__all__ = ["write_plots"]


@dataclass
class _Line:
    """One setting's runs, to draw as one line (``histories``: one per seed)."""

    label: str
    strategy: str
    beta2: float
    histories: list[dict[str, Any]]


def _lines(done: list[tuple[Run, dict[str, Any]]], records: list[dict[str, Any]]
           ) -> list[_Line]:
    """The settings to draw, in the order of the records (the best learning rate of each
    strategy only, when several were run)."""
    shown = {(r["strategy"], r["beta2"], r["lr"]): r["label"] for r in records
             if r.get("best_lr", True)}
    lines: dict[tuple, _Line] = {}
    for run, result in done:
        key = (run.strategy, run.beta2, run.lr)
        if key in shown:
            line = lines.setdefault(key, _Line(shown[key], run.strategy, run.beta2, []))
            line.histories.append(result["history"])
    return list(lines.values())


def write_plots(config: Config, done: list[tuple[Run, dict[str, Any]]],
                records: list[dict[str, Any]], out_dir: str) -> list[str]:
    """The plots' file names (written to ``out_dir``); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    lines = _lines(done, records)
    style = _styles(lines)
    written = [_plot_losses(plt, lines, style, out_dir)]
    if any(h["stats_step"] for line in lines for h in line.histories):
        written.append(_plot_edq(plt, lines, style, out_dir))
    written.append(_plot_memory(plt, [r for r in records if r.get("best_lr", True)], out_dir))
    auto = plot_auto_bytes(plt, lines, style, out_dir, _save)
    if auto is not None:
        written.append(auto)
    if config.run.seeds > 1:
        colors = {line.strategy: style(line)["color"] for line in lines}
        written.append(_plot_pareto(plt, records, colors, out_dir))
    return written


def _styles(lines: list[_Line]):
    """A line's style: one colour per strategy, one dash pattern per beta2."""
    dashes = ["-", "--", ":", "-."]
    beta2s = sorted({line.beta2 for line in lines})
    colors: dict[str, str] = {}
    for line in lines:
        colors.setdefault(line.strategy, f"C{len(colors) % 10}")

    def style(line: _Line) -> dict[str, Any]:
        return dict(color=colors[line.strategy],
                    linestyle=dashes[beta2s.index(line.beta2) % 4], label=line.label)

    return style


def _mean_and_band(series: list[list[float]]) -> tuple[list[float], list[float] | None]:
    """Pointwise mean of equally long series and the half-width of its t interval (None
    for one series: no band)."""
    n = len(series)
    columns = list(zip(*series))
    means = [math.fsum(c) / n for c in columns]
    if n < 2:
        return means, None
    factor = t_critical(n - 1) / math.sqrt(n)
    half = [factor * math.sqrt(math.fsum((v - m) ** 2 for v in c) / (n - 1))
            for c, m in zip(columns, means)]
    return means, half


def _aligned(histories: list[dict], steps: str, values: list[list[float]]
             ) -> tuple[list[float], list[list[float]]]:
    """The steps every history has under ``steps`` (seeds resumed with another
    ``--eval-every`` have different ones), and each series' values at those steps only: a
    mean over seeds is of one step's values."""
    common = set(histories[0][steps]).intersection(*(h[steps] for h in histories[1:]))
    x = [step for step in histories[0][steps] if step in common]
    return x, [[v for step, v in zip(h[steps], series) if step in common]
               for h, series in zip(histories, values)]


def _draw(ax, x: list[float], series: list[list[float]], style: dict[str, Any], **kw) -> None:
    mean, half = _mean_and_band(series)
    ax.plot(x, mean, **style, **kw)
    if half is not None:
        ax.fill_between(x, [m - h for m, h in zip(mean, half)],
                        [m + h for m, h in zip(mean, half)], color=style["color"],
                        alpha=0.2, linewidth=0)


def _plot_losses(plt, lines: list[_Line], style, out_dir: str) -> str:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    shown_train, shown_val = [], []
    for line in lines:
        hs = line.histories
        train = [_ema(h["train_loss"], 0.9) for h in hs]
        _draw(ax1, *_aligned(hs, "step", train), style(line), linewidth=1)
        _draw(ax2, *_aligned(hs, "val_step", [h["val_loss"] for h in hs]), style(line),
              marker=".", linewidth=1)
        shown_train += [v for t in train for v in t]
        shown_val += [v for h in hs for v in h["val_loss"]]
    band = " (mean over seeds, 95 % t band)" if any(len(x.histories) > 1 for x in lines) else ""
    ax1.set(title="training loss (EMA 0.9)" + band, xlabel="step", ylabel="loss (nats/token)")
    ax2.set(title="validation loss" + band, xlabel="step", ylabel="loss (nats/token)")
    _zoom(ax1, shown_train)
    _zoom(ax2, shown_val)
    ax2.legend(fontsize=8)
    return _save(plt, fig, out_dir, "loss.png")


def _plot_edq(plt, lines: list[_Line], style, out_dir: str) -> str:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for line in lines:
        hs = line.histories
        _draw(ax1, *_aligned(hs, "stats_step", [h["edq"] for h in hs]), style(line),
              linewidth=1)
        _draw(ax2, *_aligned(hs, "stats_step", [h["imprecision"] for h in hs]), style(line),
              linewidth=1)
    ax1.set(title="effective descent quality (represented weight)", xlabel="step",
            ylabel="EDQ")
    ax2.set(title="imprecision (share of lost updates)", xlabel="step", ylabel="imprecision")
    ax1.legend(fontsize=8)
    return _save(plt, fig, out_dir, "edq.png")


def _plot_memory(plt, summaries: list[dict[str, Any]], out_dir: str) -> str:
    """Persistent bytes of each run (or setting), stacked by role."""
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(summaries) + 1.5))
    labels = [s["label"] for s in summaries]
    left = [0.0] * len(summaries)
    for i, role in enumerate(ROLES):
        widths = [s["persistent"].get(role, 0) / 2**20 for s in summaries]
        if any(widths):
            ax.barh(labels, widths, left=left, color=f"C{i}", label=role.replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    for i, s in enumerate(summaries):
        ax.text(left[i], i, f" {s['bytes_per_param_measured']:.1f} B/param", va="center",
                fontsize=8)
    ax.set(xlabel="persistent MB (exact tensor bytes, after the first step)",
           title="persistent memory by role")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.set_xlim(0, max(left) * 1.25 if max(left) > 0 else 1)
    return _save(plt, fig, out_dir, "memory.png")


def _plot_pareto(plt, records: list[dict[str, Any]], colors: dict[str, str],
                 out_dir: str) -> str:
    """Final validation loss (mean ± 95 % t interval) against the memory model's bytes per
    parameter, one panel per beta2, each strategy at its best learning rate; the Pareto
    front (no other strategy is as small and better) joined by a line."""
    beta2s = sorted({r["beta2"] for r in records})
    fig, axes = plt.subplots(1, len(beta2s), figsize=(6 * len(beta2s), 4.5), squeeze=False)
    for ax, beta2 in zip(axes[0], beta2s):
        shown = [r for r in records if r["beta2"] == beta2 and r.get("best_lr", True)]
        for r in shown:
            ci = r.get("final_val_loss_ci95")
            x, y = r["bytes_per_param_model"], r["final_val_loss"]
            ax.errorbar(x, y, yerr=ci if ci is not None else None, fmt="o", capsize=3,
                        color=colors.get(r["strategy"]))
            # strategies of equal size stand in one column: their names one under another
            rank = [q["strategy"] for q in shown if q["bytes_per_param_model"] == x]
            ax.annotate(r["strategy"], (x, y), textcoords="offset points", fontsize=8,
                        xytext=(6, 3 - 10 * rank.index(r["strategy"])))
        front = pareto_front(shown)
        ax.step([r["bytes_per_param_model"] for r in front],
                [r["final_val_loss"] for r in front], where="post", color="k", alpha=0.5,
                linewidth=1, label="Pareto front (means)")
        ax.set(title=f"β2 = {beta2:g}: final validation loss vs memory",
               xlabel="bytes per parameter (memory model)",
               ylabel="final val loss (mean ± 95 % CI)")
        ax.legend(fontsize=8)
    return _save(plt, fig, out_dir, "pareto.png")


def _save(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name


def _ema(values: list[float], beta: float) -> list[float]:
    out, avg = [], None
    for v in values:
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def _zoom(ax, values: list[float]) -> None:
    """Show the interesting end of loss curves (skip the first steps' large values)."""
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if len(finite) < 4:
        return
    low, high = finite[0], finite[int(0.8 * (len(finite) - 1))]
    if high > low:
        ax.set_ylim(low - 0.05 * (high - low), high + 0.3 * (high - low))
