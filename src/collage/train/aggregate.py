"""The records of ``results.json``: one per setting (strategy, beta2, learning rate),
pooled over seeds, with the comparisons the report states.

* One seed: a record is the run's summary (today's format) with ``seed``, ``lr``,
  ``val_loss_vs_fp32`` and the memory model's bytes per parameter.
* Several seeds: a record pools its setting's runs: ``seeds``, ``per_seed`` (each seed's
  losses, EDQ, speed, initial-weight checksum), ``final_val_loss_mean``, ``_std`` and
  ``_ci95`` (the half-width of the Student t interval), means over seeds of the other
  numbers, and the paired t tests of its final validation loss against ``fp32`` and
  ``mixed`` (``paired_vs_fp32``, ``paired_vs_mixed``): seed by seed, the same initial
  weights and batches, so the test sees the strategy's effect, not the seed's.
* Several learning rates: each strategy's record at its best learning rate (the lowest
  mean final validation loss) has ``best_lr: true`` and its paired tests against the
  baselines at *their* best learning rates (``paired_vs_fp32_best``...): a strategy is
  compared at its own best setting, not only at fp32's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ..optim.autopilot import AUTO
from ..optim.strategies import NAMES
from .memory import bytes_per_param
from .runs import Run
from .stats import estimate, paired_t_test

__all__ = ["BASELINES", "REFERENCE", "pareto_front", "paired", "records"]

#: The run the "vs fp32" column compares with (same beta2, same learning rate).
REFERENCE = NAMES.fp32
#: The baselines every strategy is tested against over seeds.
BASELINES = (NAMES.fp32, NAMES.mixed)
#: Losses: a pooled record gives their mean over seeds (a diverged seed's NaN shows).
LOSSES = ("final_train_loss", "final_val_loss", "final_val_ppl", "best_val_loss")
#: Measurements: a pooled record gives the mean of the seeds that measured them.
MEANS = ("tokens_per_s", "train_time_s", "cpu_time_s", "run_time_s", "wall_time_s",
         "edq_mean", "imprecision_mean", "edq_visible_mean", "imprecision_visible_mean")
#: Memory peaks: a pooled record gives the largest over seeds.
PEAKS = ("peak_memory_bytes", "optimizer_step_peak_bytes", "process_peak_rss_bytes",
         "auto_bytes_per_param_peak")
#: What ``per_seed`` keeps of each run.
PER_SEED = ("seed", "label", "final_val_loss", "final_train_loss", "best_val_loss",
            "edq_mean", "imprecision_mean", "tokens_per_s", "wall_time_s", "init_checksum",
            "auto_decisions", "auto_bytes_per_param_final", "auto_bytes_per_param_peak")

Result = dict[str, Any]


def _finite_mean(values: Iterable[Any]) -> float:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _run_record(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    """A run's summary with the plan's seed, learning rate and label: a finished run
    reused in a comparison extended since (``--seeds``) keeps the label it was trained
    under ("bf16"), not its label in this plan ("bf16 seed=0")."""
    record = dict(summary)
    record["seed"], record["lr"], record["label"] = run.seed, run.lr, run.label
    return record


def _family_means(summaries: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    families = dict.fromkeys(f for s in summaries for f in s.get("family", {}))
    return {f: {k: _finite_mean(s["family"].get(f, {}).get(k) for s in summaries)
                for k in ("edq", "imprecision", "imprecision_visible")} for f in families}


def _pooled(runs: list[Run], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for the runs of one setting (several seeds)."""
    record = {k: v for k, v in summaries[0].items() if k not in ("init_checksum", "label")}
    record["label"] = runs[0].cell
    record["lr"] = runs[0].lr
    record["seeds"] = [run.seed for run in runs]
    for key in LOSSES:
        record[key] = math.fsum(s[key] for s in summaries) / len(summaries)
    for key in MEANS:
        record[key] = _finite_mean(s.get(key) for s in summaries)
    for key in PEAKS:
        values = [s[key] for s in summaries if s.get(key) is not None]
        record[key] = max(values) if values else None
    record["family"] = _family_means(summaries)
    record["completed"] = all(s.get("completed", True) for s in summaries)
    record["per_seed"] = [{k: _run_record(run, s).get(k) for k in PER_SEED}
                          for run, s in zip(runs, summaries)]
    losses = estimate([s["final_val_loss"] for s in summaries])
    record["final_val_loss_mean"] = losses.mean
    record["final_val_loss_std"] = losses.std
    record["final_val_loss_ci95"] = losses.ci
    return record


def _cells(done: list[tuple[Run, Result]]) -> dict[tuple[str, float, float], list]:
    """The finished runs grouped by setting, in the order of the plan."""
    cells: dict[tuple[str, float, float], list] = {}
    for run, result in done:
        cells.setdefault((run.strategy, run.beta2, run.lr), []).append((run, result))
    return cells


def _best_lrs(records: list[dict[str, Any]]) -> dict[tuple[str, float], float]:
    """Per (strategy, beta2): the learning rate of its lowest final validation loss."""
    def loss(r: dict[str, Any]) -> float:  # a diverged (NaN) setting is never the best
        return r["final_val_loss"] if math.isfinite(r["final_val_loss"]) else math.inf

    best: dict[tuple[str, float], dict[str, Any]] = {}
    for r in records:
        key = (r["strategy"], r["beta2"])
        if key not in best or loss(r) < loss(best[key]):
            best[key] = r
    return {key: r["lr"] for key, r in best.items()}


def _reference(records_by_key: dict, best: dict, name: str, beta2: float, lr: float):
    """The ``name`` record to compare with: same beta2 and learning rate, else (when
    ``name`` did not run at that rate) ``name`` at its best learning rate."""
    return records_by_key.get((name, beta2, lr)) or records_by_key.get(
        (name, beta2, best.get((name, beta2))))


def _losses_by_seed(record: dict[str, Any]) -> dict[int, float]:
    return {p["seed"]: p["final_val_loss"] for p in record.get("per_seed", [])}


def paired(record: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The paired t test of ``record``'s final validation losses minus ``reference``'s over
    the seeds both have, with the reference's learning rate."""
    a, b = _losses_by_seed(record), _losses_by_seed(reference)
    seeds = [seed for seed in a if seed in b]
    test = paired_t_test([a[s] for s in seeds], [b[s] for s in seeds])
    return {"against": reference["strategy"], "lr": reference["lr"], "seeds": seeds,
            **test.to_dict()}


def _paired_or_none(record: dict[str, Any], reference: dict[str, Any] | None):
    """The paired test, None without a reference or a seed in common (a partial
    ``--report-only``)."""
    if not reference or reference is record or not (
            _losses_by_seed(record).keys() & _losses_by_seed(reference).keys()):
        return None
    return paired(record, reference)


def _compare(records: list[dict[str, Any]], pooled: bool) -> None:
    """Add ``val_loss_vs_fp32`` (relative difference of the means), the paired tests (several
    seeds) and the best-learning-rate marks (several learning rates) to ``records``."""
    by_key = {(r["strategy"], r["beta2"], r["lr"]): r for r in records}
    best = _best_lrs(records)
    swept = len({r["lr"] for r in records}) > 1
    for r in records:
        ref = _reference(by_key, best, REFERENCE, r["beta2"], r["lr"])
        loss = ref["final_val_loss"] if ref else None
        r["val_loss_vs_fp32"] = (r["final_val_loss"] - loss) / loss if loss else None
        if pooled:
            for name in BASELINES:
                r[f"paired_vs_{name}"] = _paired_or_none(
                    r, _reference(by_key, best, name, r["beta2"], r["lr"]))
        if swept:
            r["best_lr"] = best[(r["strategy"], r["beta2"])] == r["lr"]
        if swept and pooled and r["best_lr"]:
            for name in BASELINES:
                r[f"paired_vs_{name}_best"] = _paired_or_none(
                    r, by_key.get((name, r["beta2"], best.get((name, r["beta2"])))))


def records(done: list[tuple[Run, Result]], n_seeds: int) -> list[dict[str, Any]]:
    """The records of ``results.json`` from the finished runs (see the module docstring)."""
    pooled = n_seeds > 1
    out = []
    for cell in _cells(done).values():
        runs = [run for run, _ in cell]
        summaries = [result["summary"] for _, result in cell]
        out.append(_pooled(runs, summaries) if pooled else _run_record(runs[0], summaries[0]))
    _compare(out, pooled)
    for r in out:
        # (auto: its tensors' rungs at the end, the mean over seeds)
        r["bytes_per_param_model"] = (_auto_bytes(r) if r["strategy"] == AUTO
                                      else bytes_per_param(r["strategy"]).total)
    return out


def _auto_bytes(record: dict[str, Any]) -> float:
    values = [s.get("auto_bytes_per_param_final")
              for s in record.get("per_seed") or [record]]
    return round(_finite_mean(values), 2)


def pareto_front(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records no other record dominates (as few or fewer bytes per parameter and a
    lower mean final validation loss, or fewer bytes and as low a loss), by increasing
    bytes: the memory-loss trade-offs worth having. Judged on the means; the report sets
    their intervals beside them."""
    ordered = sorted(records, key=lambda r: (r["bytes_per_param_model"], r["final_val_loss"]))
    front: list[dict[str, Any]] = []
    for r in ordered:
        if math.isfinite(r["final_val_loss"]) and (
                not front or r["final_val_loss"] < front[-1]["final_val_loss"]):
            front.append(r)
    return front
