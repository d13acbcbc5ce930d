"""The report of ``collage compare``: ``report.md`` (results, per-family EDQ, settings,
machine) and the PNG plots (losses, EDQ, persistent memory by role)."""

from __future__ import annotations

import math
import os
from typing import Any

from .config import Config
from .memory import ROLES

__all__ = ["fmt", "report_markdown", "write_plots"]

#: module families in the order of the per-family table
FAMILY_ORDER = ("embedding", "attention", "mlp", "norm", "head")


def fmt(value: Any, spec: str = ".4f") -> str:
    """``value`` formatted by ``spec``; ``-`` for a missing or non-finite number."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def report_markdown(config: Config, records: list[dict[str, Any]], env: dict[str, Any],
                    wall_time_s: float, plots: list[str]) -> str:
    """The human-readable report: results table, per-family EDQ, settings, machine."""
    lines = (_results(config, records, wall_time_s) + _legend(config, records)
             + _families(records))
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += _settings(config, records[0]) + _environment(config, env)
    return "\n".join(lines)


def _results(config: Config, records: list[dict[str, Any]], wall_time_s: float) -> list[str]:
    """The title, what was run, and one row per run."""
    first = records[0]
    lines = [
        f"# collage compare: preset `{config.preset}`",
        "",
        f"{len(records)} runs of the same {config.model.family} model "
        f"({first['n_params']:,} parameters) "
        f"from the same float32 initial weights (checksum `{first['init_checksum']}`) on the "
        f"same batches; total wall time {wall_time_s:.0f} s.",
        "",
        "## Results",
        "",
        "| strategy | β2 | val loss | vs fp32 | val ppl | train loss | EDQ | imprecision "
        "| tokens/s | wall / CPU s | persistent MB | B/param (model) | peak memory MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + [_result_row(s) for s in records]


def _result_row(s: dict[str, Any]) -> str:
    vs = s.get("val_loss_vs_fp32")
    return (
        f"| {s['strategy']} | {s['beta2']:g} | {fmt(s['final_val_loss'])} "
        f"| {('%+.2f %%' % (100 * vs)) if vs is not None else '-'} "
        f"| {fmt(s['final_val_ppl'], '.3f')} | {fmt(s['final_train_loss'])} "
        f"| {fmt(s['edq_mean'], '.4f')} | {fmt(s['imprecision_mean'], '.4f')} "
        f"| {fmt(s['tokens_per_s'], ',.0f')} "
        f"| {s['wall_time_s']:.0f} / {s['cpu_time_s']:.0f} "
        f"| {s['persistent_bytes'] / 2**20:.2f} "
        f"| {s['bytes_per_param_measured']:.2f} ({s['bytes_per_param_model']}) "
        f"| {s['peak_memory_bytes'] / 2**20:.0f} |"
    )


def _legend(config: Config, records: list[dict[str, Any]]) -> list[str]:
    """What each column of the results means."""
    return [
        "",
        "*val loss*: mean token cross-entropy (nats per byte) on the fixed validation batches "
        "after the last step; *vs fp32*: relative difference to the fp32 run with the same β2. "
        "*EDQ* (effective descent quality, `<e, d> / ||d||²`) and *imprecision* (share of "
        "weights whose intended non-zero update was lost) are averaged over the measured "
        f"steps (every {config.run.track_every}); they concern the represented weight (hi + "
        "lo, the master copy). *tokens/s* excludes evaluation, measured steps, the step whose "
        "memory is measured and the first step. "
        "*wall / CPU s*: seconds the run took and CPU seconds its process used (with one "
        "thread per run, wall well above CPU means the machine was busy with other work, "
        "which slows tokens/s too). "
        "*persistent MB*: exact bytes of weights, gradients and optimizer states after a step "
        "(tensor storages, deduplicated); *B/param*: measured bytes per parameter, with the "
        "memory model's number in brackets (see `collage memory`).",
        "",
        _memory_note(records),
        "",
    ]


def _memory_note(records: list[dict[str, Any]]) -> str:
    measured = str(records[0]["peak_memory_measured"])
    if measured.startswith(("cuda_max_memory_allocated", "cpu_allocator_events")):
        how = ("`torch.cuda.max_memory_allocated`" if measured.startswith("cuda")
               else "torch's profiler, which sees every allocation and free of the CPU "
               "allocator, replayed on top of the persistent bytes")
        step = measured.split(", ")[1] if ", " in measured else "one step"
        return ("*peak memory*: the most bytes held by tensors during one training step "
                f"({step}: forward, backward, clipping, optimizer step), measured by {how}: "
                "the persistent tensors plus activations and temporaries. The process's "
                "peak resident set (Python, the torch libraries, the data) is in "
                "`process_peak_rss_bytes`.")
    return ("*peak memory*: peak resident set size of the process that trained the strategy "
            "(`getrusage` `ru_maxrss`: a resumed run that did not measure a step). It "
            "includes the Python interpreter and the torch libraries; the exact "
            "per-strategy numbers are the *persistent MB* column.")


def _families(records: list[dict[str, Any]]) -> list[str]:
    """EDQ / imprecision per module family and run (nothing when no family was measured)."""
    families = [f for f in FAMILY_ORDER if any(f in s.get("family", {}) for s in records)]
    if not families:
        return []
    lines = [
        "## EDQ and imprecision per module family",
        "",
        "| strategy | β2 | " + " | ".join(f"{f} EDQ / impr." for f in families) + " |",
        "|---|---|" + "---|" * len(families),
    ]
    for s in records:
        cells = []
        for f in families:
            fam = s.get("family", {}).get(f, {})
            cells.append(f"{fmt(fam.get('edq'), '.3f')} / {fmt(fam.get('imprecision'), '.3f')}")
        lines.append(f"| {s['strategy']} | {s['beta2']:g} | " + " | ".join(cells) + " |")
    return lines + [""]


def _settings(config: Config, first: dict[str, Any]) -> list[str]:
    """Model, data, optimizer and run settings, one line each."""
    m, d, o, r = config.model, config.data, config.optim, config.run
    return [
        "## Settings",
        "",
        f"- model: {m.family}{' (transformers)' if m.hf else ''}, d_model {m.d_model}, "
        f"{m.n_layers} layers, {m.n_heads} heads, MLP {m.ffn_dim}, context {m.context}, "
        f"tied embeddings {m.tie_weights}, dropout {m.dropout}, init std {m.init_std}",
        f"- data: {first['data_source']}; byte-level tokens (vocabulary 257); "
        f"{first['train_tokens']:,} train / {first['val_tokens']:,} validation tokens; "
        f"batch {d.batch_size} x {m.context} = {d.batch_size * m.context:,} tokens per step"
        + (f"; MLM masking {d.mlm_probability}" if m.family == "bert" else ""),
        f"- optimizer: collage.AdamW lr {o.lr:g}, betas ({o.beta1:g}, "
        + (", ".join(f"{b:g}" for b in r.beta2s) if r.beta2s else f"{o.beta2:g}")
        + f"), eps {o.eps:g}, weight decay {o.weight_decay:g} (matrices and embeddings), "
        f"{o.warmup_steps} warm-up steps then {o.schedule} to {o.min_lr_ratio:g} x lr, "
        f"gradient clipping {o.grad_clip:g}",
        f"- run: {r.steps} steps, seed {r.seed}, validation every {r.eval_every} steps on "
        f"{r.eval_batches} fixed batches, EDQ measured every {r.track_every} steps, device "
        f"{first['device']}, {first['threads']} torch threads per run, "
        + (f"one fresh process per strategy, {first.get('jobs', 1)} at a time"
           if r.isolate else "one process for all strategies"),
        "",
    ]


def _environment(config: Config, env: dict[str, Any]) -> list[str]:
    return (["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
            + ["", f"Reproduce: `collage compare --preset {config.preset} ...` "
               "(the full configuration is in `config.json`).", ""])


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def write_plots(results: list[dict[str, Any]], out_dir: str) -> list[str]:
    """loss.png, edq.png, memory.png (matplotlib, Agg backend); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    style = _styles(results)
    written = [_plot_losses(plt, results, style, out_dir)]
    if any(r["history"]["stats_step"] for r in results):
        written.append(_plot_edq(plt, results, style, out_dir))
    written.append(_plot_memory(plt, results, out_dir))
    return written


def _styles(results: list[dict[str, Any]]):
    """A run's line style: one colour per strategy, one dash pattern per beta2."""
    dashes = ["-", "--", ":", "-."]
    beta2s = sorted({r["summary"]["beta2"] for r in results})
    colors: dict[str, str] = {}
    for r in results:
        colors.setdefault(r["summary"]["strategy"], f"C{len(colors) % 10}")

    def style(r: dict[str, Any]) -> dict[str, Any]:
        s = r["summary"]
        return dict(color=colors[s["strategy"]], linestyle=dashes[beta2s.index(s["beta2"]) % 4],
                    label=s["label"])

    return style


def _plot_losses(plt, results: list[dict[str, Any]], style, out_dir: str) -> str:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        h = r["history"]
        ax1.plot(h["step"], _ema(h["train_loss"], 0.9), linewidth=1, **style(r))
        ax2.plot(h["val_step"], h["val_loss"], marker=".", linewidth=1, **style(r))
    ax1.set(title="training loss (EMA 0.9)", xlabel="step", ylabel="loss (nats/token)")
    ax2.set(title="validation loss", xlabel="step", ylabel="loss (nats/token)")
    _zoom(ax1, [v for r in results for v in _ema(r["history"]["train_loss"], 0.9)])
    _zoom(ax2, [v for r in results for v in r["history"]["val_loss"]])
    ax2.legend(fontsize=8)
    return _save(plt, fig, out_dir, "loss.png")


def _plot_edq(plt, results: list[dict[str, Any]], style, out_dir: str) -> str:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        h = r["history"]
        ax1.plot(h["stats_step"], h["edq"], linewidth=1, **style(r))
        ax2.plot(h["stats_step"], h["imprecision"], linewidth=1, **style(r))
    ax1.set(title="effective descent quality (represented weight)", xlabel="step",
            ylabel="EDQ")
    ax2.set(title="imprecision (share of lost updates)", xlabel="step", ylabel="imprecision")
    ax1.legend(fontsize=8)
    return _save(plt, fig, out_dir, "edq.png")


def _plot_memory(plt, results: list[dict[str, Any]], out_dir: str) -> str:
    """Persistent bytes of each run, stacked by role."""
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(results) + 1.5))
    labels = [r["summary"]["label"] for r in results]
    left = [0.0] * len(results)
    for i, role in enumerate(ROLES):
        widths = [r["summary"]["persistent"].get(role, 0) / 2**20 for r in results]
        if any(widths):
            ax.barh(labels, widths, left=left, color=f"C{i}", label=role.replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    for i, r in enumerate(results):
        s = r["summary"]
        ax.text(left[i], i, f" {s['bytes_per_param_measured']:.1f} B/param", va="center",
                fontsize=8)
    ax.set(xlabel="persistent MB (exact tensor bytes, after the first step)",
           title="persistent memory by role")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.set_xlim(0, max(left) * 1.25 if max(left) > 0 else 1)
    return _save(plt, fig, out_dir, "memory.png")


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
