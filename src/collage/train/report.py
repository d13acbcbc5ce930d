"""The report of ``collage compare``: ``report.md`` (results, per-family EDQ, settings,
machine); the plots are ``collage.train.plots``'."""

from __future__ import annotations

from typing import Any

from .config import Config
from .gemm import Bf16Gemm
from .report_auto import auto_section
from .report_sweeps import (
    best_lr_section,
    fmt,
    pareto_section,
    per_seed_table,
    seed_legend,
    seed_results,
)

__all__ = ["fmt", "report_markdown"]

#: module families in the order of the per-family table
FAMILY_ORDER = ("embedding", "attention", "mlp", "norm", "head")


def report_markdown(config: Config, records: list[dict[str, Any]], env: dict[str, Any],
                    wall_time_s: float, plots: list[str]) -> str:
    """The human-readable report: results (over seeds: mean ± interval and paired tests;
    over learning rates: each strategy's best), per-family EDQ, settings, machine."""
    pooled, swept = config.run.seeds > 1, bool(config.run.lrs)
    lines = _title(config, records, wall_time_s)
    if pooled:
        lines += seed_results(records, swept) + seed_legend(records)
        lines += ["## Measurements (means over seeds)", ""]
    else:
        lines += ["## Results", ""]
    lines += _table(records, swept) + _legend(config, records)
    if swept:
        lines += best_lr_section(records)
    if pooled:
        lines += pareto_section(records) + per_seed_table(records, swept)
    lines += _families(records, swept) + auto_section(records)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += _settings(config, records[0]) + _environment(config, env)
    return "\n".join(lines)


def _title(config: Config, records: list[dict[str, Any]], wall_time_s: float) -> list[str]:
    """The title and what was run."""
    first = records[0]
    if "per_seed" in first:
        checksums = {p["seed"]: p["init_checksum"] for r in records for p in r["per_seed"]}
        runs = sum(len(r["per_seed"]) for r in records)
        what = (f"{runs} runs ({len(records)} settings, {len(checksums)} seeds) of the same "
                f"{config.model.family} model ({first['n_params']:,} parameters), each seed's "
                "from the same float32 initial weights (checksums "
                + ", ".join(f"seed {k} `{v}`" for k, v in sorted(checksums.items()))
                + ") on the same batches")
    else:
        what = (f"{len(records)} runs of the same {config.model.family} model "
                f"({first['n_params']:,} parameters) from the same float32 initial weights "
                f"(checksum `{first['init_checksum']}`) on the same batches")
    return [f"# collage compare: preset `{config.preset}`", "",
            f"{what}; total wall time {wall_time_s:.0f} s.", ""] + _machine(records)


def _machine(records: list[dict[str, Any]]) -> list[str]:
    """The machine the runs' exact figures came from (they depend on the CPU and torch's
    kernels), one line per distinct machine, and how their bf16 matrix products were
    computed; nothing for records that do not say (made before they did)."""
    machines: list[dict[str, Any]] = []
    for m in (r["machine"] for r in records if r.get("machine")):
        if m not in machines:
            machines.append(m)
    lines = [f"Machine: {m['cpu']}" + (f", {m['gpu']}" if m.get("gpu") else "")
             + f", torch {m['torch']} (CPU capability {m['cpu_capability']})."
             for m in machines]
    gemm = _gemm(records)
    if gemm:
        lines.append(f"bf16 matrix multiplies: {gemm}.")
    return [part for line in lines for part in (line, "")]


def _gemm(records: list[dict[str, Any]]) -> str | None:
    """How the runs' bf16 matrix products were computed: one description when the runs
    with bf16 weights agree (the float32 run has none to describe), else one per group."""
    groups: dict[str, list[str]] = {}
    for r in records:
        if "bf16_gemm" in r and r["bf16_gemm"] is not None:
            groups.setdefault(Bf16Gemm.from_record(r).describe(), []).append(r["label"])
    if len(groups) <= 1:
        return next(iter(groups), None)
    return "; ".join(f"{', '.join(labels)}: {text}" for text, labels in groups.items())


def _table(records: list[dict[str, Any]], swept: bool) -> list[str]:
    """One row per record (a run, or a setting's mean over seeds)."""
    lr = "| lr " if swept else ""
    lines = [
        f"| strategy | β2 {lr}| val loss | vs fp32 | val ppl | train loss | EDQ | imprecision "
        "| tokens/s | wall / CPU s | persistent MB | B/param (model) | peak memory MB |",
        "|---|---|" + ("---|" if swept else "") + "---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + [_result_row(s, swept) for s in records]


def _result_row(s: dict[str, Any], swept: bool = False) -> str:
    vs = s.get("val_loss_vs_fp32")
    lr = f"| {s['lr']:g} " if swept else ""
    return (
        f"| {s['strategy']} | {s['beta2']:g} {lr}| {fmt(s['final_val_loss'])} "
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
        "*val loss*: mean cross-entropy per token (nats; a token is a byte with the byte "
        "tokenizer) on the fixed validation batches after the last step; *vs fp32*: "
        "relative difference to the fp32 run with the same β2. "
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


def _families(records: list[dict[str, Any]], swept: bool) -> list[str]:
    """EDQ / imprecision per module family and record (nothing when no family was
    measured)."""
    families = [f for f in FAMILY_ORDER if any(f in s.get("family", {}) for s in records)]
    if not families:
        return []
    lines = [
        "## EDQ and imprecision per module family",
        "",
        "| strategy | β2 | " + ("lr | " if swept else "")
        + " | ".join(f"{f} EDQ / impr." for f in families) + " |",
        "|---|---|" + ("---|" if swept else "") + "---|" * len(families),
    ]
    for s in records:
        cells = [f"{s['lr']:g}"] if swept else []
        for f in families:
            fam = s.get("family", {}).get(f, {})
            cells.append(f"{fmt(fam.get('edq'), '.3f')} / {fmt(fam.get('imprecision'), '.3f')}")
        lines.append(f"| {s['strategy']} | {s['beta2']:g} | " + " | ".join(cells) + " |")
    return lines + [""]


def _tokens(d) -> str:
    if d.tokenizer == "bytes":
        return "byte-level tokens (vocabulary 257)"
    return f"byte-level BPE tokens (vocabulary {d.vocab_size})"


def _learning_rates(o, r) -> str:
    if not r.lrs:
        return f"{o.lr:g}"
    swept = ", ".join(f"{lr:g}" for lr in r.lrs)
    if not r.lrs_strategies:
        return f"{swept} (each strategy at each)"
    return f"{swept} ({', '.join(r.lrs_strategies)}; the others {o.lr:g})"


def _settings(config: Config, first: dict[str, Any]) -> list[str]:
    """Model, data, optimizer and run settings, one line each."""
    m, d, o, r = config.model, config.data, config.optim, config.run
    return [
        "## Settings",
        "",
        f"- model: {m.family}{' (transformers)' if m.hf else ''}, d_model {m.d_model}, "
        f"{m.n_layers} layers, {m.n_heads} heads, MLP {m.ffn_dim}, context {m.context}, "
        f"tied embeddings {m.tie_weights}, dropout {m.dropout}, init std {m.init_std}",
        f"- data: {first['data_source']}; {_tokens(d)}; "
        f"{first['train_tokens']:,} train / {first['val_tokens']:,} validation tokens; "
        f"batch {d.batch_size} x {m.context} = {d.batch_size * m.context:,} tokens per step"
        + (f"; MLM masking {d.mlm_probability}" if m.family == "bert" else ""),
        f"- optimizer: collage.AdamW lr {_learning_rates(o, r)}, betas ({o.beta1:g}, "
        + (", ".join(f"{b:g}" for b in r.beta2s) if r.beta2s else f"{o.beta2:g}")
        + f"), eps {o.eps:g}, weight decay {o.weight_decay:g} (matrices and embeddings), "
        f"{o.warmup_steps} warm-up steps then {o.schedule} to {o.min_lr_ratio:g} x lr, "
        f"gradient clipping {o.grad_clip:g}",
        f"- run: {r.steps} steps, "
        + (f"seeds {r.seed}-{r.seed + r.seeds - 1}" if r.seeds > 1 else f"seed {r.seed}")
        + f", validation every {r.eval_every} steps on "
        f"{first.get('val_batches', r.eval_batches)} fixed batches, "
        + (f"EDQ measured every {r.track_every} steps" if r.track_every else "EDQ not measured")
        + f", device "
        f"{first['device']}, {first['threads']} torch threads per run, "
        + (f"one fresh process per strategy, {first.get('jobs', 1)} at a time"
           if r.isolate else "one process for all strategies"),
        "",
    ]


def _environment(config: Config, env: dict[str, Any]) -> list[str]:
    return (["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
            + ["", f"Reproduce: `collage compare --preset {config.preset} ...` "
               "(the full configuration is in `config.json`).", ""])
