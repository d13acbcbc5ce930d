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

from .build import initial_weights, state_checksum
from .config import Config
from .memory import bytes_per_param
from .report import fmt, report_markdown, write_plots
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


#: The run the "vs fp32" column compares with (same beta2).
REFERENCE = "fp32"


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
            f"EDQ {fmt(s['edq_mean'], '.3f')}  {fmt(s['tokens_per_s'], ',.0f')} tok/s  "
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
                 for r in results if r["summary"]["strategy"] == REFERENCE}
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
