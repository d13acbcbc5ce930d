"""The files ``collage compare`` writes to ``--out``: ``results.json`` (the records of
``collage.train.aggregate``), ``results.csv``, ``history.json`` (per run), ``config.json``
(configuration, machine, command line), ``report.md`` and the plots."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import sys
from typing import Any

import torch

import collage

from .aggregate import records as make_records
from .config import Config
from .plots import write_plots
from .report import report_markdown
from .runs import Run

__all__ = ["CSV_FIELDS", "environment", "machine", "write_json", "write_outputs"]

CSV_FIELDS = (
    "label", "strategy", "beta2", "final_val_loss", "final_val_ppl", "val_loss_vs_fp32",
    "final_train_loss", "best_val_loss", "edq_mean", "imprecision_mean", "edq_visible_mean",
    "imprecision_visible_mean", "tokens_per_s", "train_time_s", "wall_time_s",
    "cpu_time_s", "persistent_bytes", "bytes_per_param_measured", "bytes_per_param_model",
    "peak_memory_bytes", "peak_memory_measured", "optimizer_step_peak_bytes",
    "process_peak_rss_bytes", "rss_before_bytes", "n_params", "steps", "bf16_gemm",
)
#: Columns added with several learning rates, and with several seeds.
CSV_SWEEP_FIELDS = ("lr", "best_lr")
CSV_SEED_FIELDS = ("final_val_loss_mean", "final_val_loss_std", "final_val_loss_ci95")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str = "cpu") -> dict[str, Any]:
    """What a run's exact figures depend on: the CPU model, the vector kernels torch
    dispatches to on it (``torch.backends.cpu.get_cpu_capability()``), torch's version,
    and the GPU when the run used one."""
    found = {"cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
             "torch": torch.__version__}
    if device != "cpu" and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions and machine, for the report."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "collage": collage.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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


def _csv_fields(config: Config) -> tuple[str, ...]:
    return (CSV_FIELDS + (CSV_SWEEP_FIELDS if config.run.lrs else ())
            + (CSV_SEED_FIELDS if config.run.seeds > 1 else ()))


def write_outputs(config: Config, done: list[tuple[Run, dict[str, Any]]], out_dir: str, *,
                  wall_time_s: float) -> None:
    """results.json/.csv, history.json, config.json, report.md and the plots of the
    finished runs ``done`` (each with its ``{"summary", "history"}``)."""
    records = make_records(done, config.run.seeds)
    env = environment(config.run.device)
    settings = {"config": config.to_dict(), "environment": env, "wall_time_s": wall_time_s,
                "command": "collage " + " ".join(sys.argv[1:]) if sys.argv else ""}
    write_json(os.path.join(out_dir, "results.json"), records)
    write_json(os.path.join(out_dir, "config.json"), settings)
    write_json(os.path.join(out_dir, "history.json"),
               {run.label: result["history"] for run, result in done})
    fields = _csv_fields(config)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for s in records:
            writer.writerow({k: _csv_value(s.get(k)) for k in fields})
    plots = write_plots(config, done, records, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w") as handle:
        handle.write(report_markdown(config, records, env, wall_time_s, plots))


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return "" if value is None else value


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented JSON, non-finite floats as null."""
    with open(path, "w") as handle:
        json.dump(_finite_or_none(obj), handle, indent=1)
        handle.write("\n")
