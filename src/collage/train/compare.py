"""``collage compare``: the same model, data and seeds under several precision strategies.

The float32 initial weights are built once from the seed and converted per strategy; every
strategy reads the same batches in the same order. By default each strategy runs in a fresh
``spawn``-ed process, so that the process's peak resident memory (``ru_maxrss``) belongs to
that strategy alone. Output (``--out DIR``): ``results.json``, ``results.csv``,
``history.json``, ``config.json``, ``report.md`` and PNG plots.
"""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from queue import Empty
from typing import Any

import torch

import collage

from .config import Config
from .memory import ROLES, bytes_per_param
from .build import initial_weights, state_checksum
from .runner import train_strategy

__all__ = ["compare", "environment", "write_outputs", "write_json", "CSV_FIELDS"]

CSV_FIELDS = (
    "label", "strategy", "beta2", "final_val_loss", "final_val_ppl", "val_loss_vs_fp32",
    "final_train_loss", "best_val_loss", "edq_mean", "imprecision_mean", "edq_visible_mean",
    "imprecision_visible_mean", "tokens_per_s", "train_time_s", "wall_time_s",
    "cpu_time_s", "persistent_bytes", "bytes_per_param_measured", "bytes_per_param_model",
    "peak_memory_bytes", "peak_memory_measured", "optimizer_step_peak_bytes",
    "process_peak_rss_bytes", "rss_before_bytes", "n_params", "steps",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions and machine, for the report."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "collage": collage.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        env["cpu_cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    if device != "cpu" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def _run_one(config_dict: dict[str, Any], strategy: str, beta2: float, label: str,
             init: dict[str, torch.Tensor], threads: int | None, isolated: bool,
             progress=None) -> dict[str, Any]:
    """Train one strategy; the part of the result that crosses process boundaries."""
    config = Config.from_dict(config_dict)
    t0 = time.perf_counter()
    result = train_strategy(config, strategy, beta2=beta2, init=init, label=label,
                            progress=progress, threads=threads)
    summary = result["summary"]
    summary["wall_time_s"] = time.perf_counter() - t0
    summary["isolated"] = isolated
    return {"summary": summary, "history": result["history"]}


def _child(index: int, queue, config_dict: dict[str, Any], strategy: str, beta2: float,
           label: str, init_path: str, threads: int | None) -> None:
    """Entry point of a spawned process: train, report progress and the result on ``queue``."""
    pending = [0, time.monotonic()]

    def progress(n: int) -> None:  # batch the messages: at most about 5 per second
        pending[0] += n
        if time.monotonic() - pending[1] > 0.2:
            queue.put(("progress", index, pending[0]))
            pending[0], pending[1] = 0, time.monotonic()

    try:
        init = torch.load(init_path, map_location="cpu", weights_only=True)
        result = _run_one(config_dict, strategy, beta2, label, init, threads, True, progress)
        if pending[0]:
            queue.put(("progress", index, pending[0]))
        queue.put(("done", index, result))
    except BaseException as error:  # report everything; the parent decides
        try:
            queue.put(("error", index, error))
        except Exception:  # an unpicklable exception: send its text
            queue.put(("error", index, RuntimeError(f"{type(error).__name__}: {error}")))


def _jobs(config: Config) -> list[tuple[str, float, str]]:
    beta2s = config.run.beta2s or (config.optim.beta2,)
    jobs = []
    for beta2 in beta2s:
        for strategy in config.run.strategy_list():
            label = strategy if len(beta2s) == 1 else f"{strategy} b2={beta2:g}"
            jobs.append((strategy, beta2, label))
    return jobs


def _bar(total: int, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="compare", unit="step", dynamic_ncols=True, file=sys.stderr)


def compare(config: Config, out_dir: str, *, log=print) -> list[dict[str, Any]]:
    """Run every strategy (and beta2) of ``config``, write the outputs, return the records.

    With ``config.run.isolate`` each run is a fresh ``spawn``-ed process (``jobs`` of them at
    a time, ``threads`` torch threads each); otherwise all run here, one after the other.
    """
    os.makedirs(out_dir, exist_ok=True)
    init = initial_weights(config)
    checksum = state_checksum(init)
    jobs = _jobs(config)
    n_jobs = config.run.resolved_jobs(len(jobs))
    threads = config.run.resolved_threads(n_jobs) if config.run.isolate else config.run.threads
    started = time.time()
    bar = _bar(len(jobs) * config.run.steps, config.run.quiet)
    say = (lambda msg: (bar.write(msg) if bar is not None else log(msg))) if log else None
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    try:
        if config.run.isolate:
            _run_isolated(config, jobs, init, out_dir, n_jobs, threads, results, bar, say)
        else:
            update = bar.update if bar is not None else None
            for i, (strategy, beta2, label) in enumerate(jobs):
                results[i] = _run_one(config.to_dict(), strategy, beta2, label, init, threads,
                                      False, update)
                _log_result(say, results[i]["summary"], config.run.quiet)
    finally:
        if bar is not None:
            bar.close()
    done = [r for r in results if r is not None]
    for r in done:
        if r["summary"]["init_checksum"] != checksum:  # a broken invariant, not a user error
            raise RuntimeError(f"{r['summary']['label']} did not start from the shared initial "
                               "weights")
    for r in done:
        r["summary"]["jobs"] = n_jobs
    write_outputs(config, done, out_dir, wall_time_s=time.time() - started)
    return [r["summary"] for r in done]


def _run_isolated(config, jobs, init, out_dir, n_jobs, threads, results, bar, say) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix=".init-", dir=out_dir) as tmp:
        init_path = os.path.join(tmp, "init.pt")
        torch.save(init, init_path)
        waiting = list(range(len(jobs)))
        running: dict[int, Any] = {}
        try:
            while waiting or running:
                while waiting and len(running) < n_jobs:
                    i = waiting.pop(0)
                    strategy, beta2, label = jobs[i]
                    proc = ctx.Process(target=_child, name=f"collage-{label}", daemon=True,
                                       args=(i, queue, config.to_dict(), strategy, beta2,
                                             label, init_path, threads))
                    proc.start()
                    running[i] = proc
                    if bar is not None:
                        bar.set_postfix_str(", ".join(jobs[j][2] for j in sorted(running)))
                try:
                    kind, i, payload = queue.get(timeout=1.0)
                except Empty:  # check for children that died without a word
                    for j, proc in list(running.items()):
                        if not proc.is_alive() and queue.empty():
                            proc.join(1.0)
                            raise RuntimeError(
                                f"the process training {jobs[j][2]!r} died (exit code "
                                f"{proc.exitcode}) without a result; out of memory?"
                            ) from None
                    continue
                if kind == "progress":
                    if bar is not None:
                        bar.update(payload)
                    continue
                running.pop(i).join()
                if kind == "error":
                    raise payload
                results[i] = payload
                _log_result(say, payload["summary"], config.run.quiet)
        finally:
            for proc in running.values():
                if proc.is_alive():
                    proc.terminate()
                proc.join()


def _log_result(log, s: dict[str, Any], quiet: bool) -> None:
    if not quiet and log is not None:
        log(f"{s['label']:<16} val loss {s['final_val_loss']:.4f}  "
            f"EDQ {_fmt(s['edq_mean'], '.3f')}  {_fmt(s['tokens_per_s'], ',.0f')} tok/s  "
            f"{s['wall_time_s']:.1f} s")


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summaries with the derived columns (loss vs fp32, the memory model's bytes/param)."""
    reference = {r["summary"]["beta2"]: r["summary"]["final_val_loss"]
                 for r in results if r["summary"]["strategy"] == "fp32"}
    records = []
    for r in results:
        s = dict(r["summary"])
        ref = reference.get(s["beta2"])
        s["val_loss_vs_fp32"] = (s["final_val_loss"] - ref) / ref if ref else None
        s["bytes_per_param_model"] = bytes_per_param(s["strategy"]).total
        records.append(s)
    return records


def write_outputs(config: Config, results: list[dict[str, Any]], out_dir: str, *,
                  wall_time_s: float) -> None:
    """results.json/.csv, history.json, config.json, report.md and the plots."""
    records = _records(results)
    env = environment(config.run.device)
    settings = {"config": config.to_dict(), "environment": env, "wall_time_s": wall_time_s,
                "command": "collage " + " ".join(sys.argv[1:]) if sys.argv else ""}
    write_json(os.path.join(out_dir, "results.json"), records)
    write_json(os.path.join(out_dir, "config.json"), settings)
    write_json(os.path.join(out_dir, "history.json"),
                {r["summary"]["label"]: r["history"] for r in results})
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for s in records:
            writer.writerow({k: _csv_value(s.get(k)) for k in CSV_FIELDS})
    plots = write_plots(results, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w") as handle:
        handle.write(report_markdown(config, records, env, wall_time_s, plots))


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return "" if value is None else value


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented JSON, non-finite floats as null."""
    with open(path, "w") as handle:
        json.dump(_finite_or_none(obj), handle, indent=1)
        handle.write("\n")


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def report_markdown(config: Config, records: list[dict[str, Any]], env: dict[str, Any],
                    wall_time_s: float, plots: list[str]) -> str:
    """The human-readable report: results table, per-family EDQ, settings, machine."""
    m, d, o, r = config.model, config.data, config.optim, config.run
    first = records[0]
    lines = [
        f"# collage compare: preset `{config.preset}`",
        "",
        f"{len(records)} runs of the same {m.family} model ({first['n_params']:,} parameters) "
        f"from the same float32 initial weights (checksum `{first['init_checksum']}`) on the "
        f"same batches; total wall time {wall_time_s:.0f} s.",
        "",
        "## Results",
        "",
        "| strategy | β2 | val loss | vs fp32 | val ppl | train loss | EDQ | imprecision "
        "| tokens/s | wall / CPU s | persistent MB | B/param (model) | peak memory MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in records:
        vs = s.get("val_loss_vs_fp32")
        lines.append(
            f"| {s['strategy']} | {s['beta2']:g} | {_fmt(s['final_val_loss'])} "
            f"| {('%+.2f %%' % (100 * vs)) if vs is not None else '-'} "
            f"| {_fmt(s['final_val_ppl'], '.3f')} | {_fmt(s['final_train_loss'])} "
            f"| {_fmt(s['edq_mean'], '.4f')} | {_fmt(s['imprecision_mean'], '.4f')} "
            f"| {_fmt(s['tokens_per_s'], ',.0f')} "
            f"| {s['wall_time_s']:.0f} / {s['cpu_time_s']:.0f} "
            f"| {s['persistent_bytes'] / 2**20:.2f} "
            f"| {s['bytes_per_param_measured']:.2f} ({s['bytes_per_param_model']}) "
            f"| {s['peak_memory_bytes'] / 2**20:.0f} |"
        )
    lines += [
        "",
        "*val loss*: mean token cross-entropy (nats per byte) on the fixed validation batches "
        "after the last step; *vs fp32*: relative difference to the fp32 run with the same β2. "
        "*EDQ* (effective descent quality, `<e, d> / ||d||²`) and *imprecision* (share of "
        "weights whose intended non-zero update was lost) are averaged over the measured "
        f"steps (every {r.track_every}); they concern the represented weight (hi + lo, the "
        "master copy). *tokens/s* excludes evaluation, measured steps, the step whose memory is "
        "measured and the first step. "
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
    families = [f for f in ("embedding", "attention", "mlp", "norm", "head")
                if any(f in s.get("family", {}) for s in records)]
    if families:
        lines += [
            "## EDQ and imprecision per module family",
            "",
            "| strategy | β2 | " + " | ".join(f"{f} EDQ / impr." for f in families) + " |",
            "|---|---|" + "---|" * len(families),
        ]
        for s in records:
            cells = []
            for f in families:
                fam = s.get("family", {}).get(f, {})
                cells.append(f"{_fmt(fam.get('edq'), '.3f')} / "
                             f"{_fmt(fam.get('imprecision'), '.3f')}")
            lines.append(f"| {s['strategy']} | {s['beta2']:g} | " + " | ".join(cells) + " |")
        lines += [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += [
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
        "## Environment",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", f"Reproduce: `collage compare --preset {config.preset} ...` "
              "(the full configuration is in `config.json`).", ""]
    return "\n".join(lines)


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


def write_plots(results: list[dict[str, Any]], out_dir: str) -> list[str]:
    """loss.png, edq.png, memory.png (matplotlib, Agg backend); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    styles = ["-", "--", ":", "-."]
    beta2s = sorted({r["summary"]["beta2"] for r in results})
    colors = {}
    for r in results:
        colors.setdefault(r["summary"]["strategy"], f"C{len(colors) % 10}")

    def style(r):
        s = r["summary"]
        return dict(color=colors[s["strategy"]], linestyle=styles[beta2s.index(s["beta2"]) % 4],
                    label=s["label"])

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
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)
    plt.close(fig)
    written.append("loss.png")

    if any(r["history"]["stats_step"] for r in results):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in results:
            h = r["history"]
            ax1.plot(h["stats_step"], h["edq"], linewidth=1, **style(r))
            ax2.plot(h["stats_step"], h["imprecision"], linewidth=1, **style(r))
        ax1.set(title="effective descent quality (represented weight)", xlabel="step",
                ylabel="EDQ")
        ax2.set(title="imprecision (share of lost updates)", xlabel="step",
                ylabel="imprecision")
        ax1.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "edq.png"), dpi=110)
        plt.close(fig)
        written.append("edq.png")

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
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory.png"), dpi=110)
    plt.close(fig)
    written.append("memory.png")
    return written


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
