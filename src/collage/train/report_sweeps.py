"""The report's sections over seeds and learning rates (``collage compare --seeds N
--lrs ...``): mean ± Student t interval, the paired tests against fp32 and mixed, each
strategy's best learning rate, the memory-loss Pareto front, every seed's value."""

from __future__ import annotations

import math
from typing import Any

from .aggregate import BASELINES, pareto_front
from .stats import CONFIDENCE, Estimate

__all__ = ["best_lr_section", "fmt", "pareto_section", "per_seed_table", "seed_legend",
           "seed_results"]

LEVEL = f"{100 * (1 - CONFIDENCE):g} %"


def fmt(value: Any, spec: str = ".4f") -> str:
    """``value`` formatted by ``spec``; ``-`` for a missing or non-finite number."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _loss(r: dict[str, Any]) -> str:
    """``mean ± ci`` of the final validation loss, saying so where no interval exists."""
    n = len(r.get("per_seed", [])) or 1
    estimate = Estimate(n=n, mean=r["final_val_loss"], std=r.get("final_val_loss_std"),
                        ci=r.get("final_val_loss_ci95"))
    text = estimate.text() if math.isfinite(r["final_val_loss"]) else "diverged"
    return text if estimate.ci is not None or n > 1 else f"{text} (1 seed: no interval)"


def _paired(test: dict[str, Any] | None) -> tuple[str, str]:
    """A paired test as two cells: the mean difference ± its interval, and the verdict."""
    if test is None:
        return "-", "-"
    diff = f"{fmt(test['mean_difference'], '+.4f')}"
    if test["ci95_difference"] is not None:
        diff += f" ± {test['ci95_difference']:.4f}"
    if test["p"] is None:
        return diff, f"untestable ({test['n']} seed{'s' if test['n'] != 1 else ''})"
    verdict = "**yes**" if test["significant"] else "no"
    return diff, f"{verdict} (p {test['p']:.3g})"


def seed_results(records: list[dict[str, Any]], swept: bool) -> list[str]:
    """The headline table: each setting's loss over seeds and its paired tests."""
    lr = "lr | " if swept else ""
    heads = " | ".join(f"Δ vs {b} | significant?" for b in BASELINES)
    lines = ["## Results over seeds", "",
             f"| strategy | β2 | {lr}val loss (mean ± 95 % CI) | vs fp32 | {heads} "
             "| B/param (model) | tokens/s |",
             "|---|---|" + ("---|" if swept else "") + "---|---|" + "---|---|" * len(BASELINES)
             + "---|---|"]
    for r in records:
        vs = r.get("val_loss_vs_fp32")
        cells = [r["strategy"], f"{r['beta2']:g}"] + ([f"{r['lr']:g}"] if swept else [])
        cells += [_loss(r), ("%+.2f %%" % (100 * vs)) if vs is not None else "-"]
        for name in BASELINES:
            cells += list(_paired(r.get(f"paired_vs_{name}")))
        cells += [str(r["bytes_per_param_model"]), fmt(r["tokens_per_s"], ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def seed_legend(records: list[dict[str, Any]]) -> list[str]:
    """How the numbers over seeds were computed."""
    seeds = sorted({p["seed"] for r in records for p in r.get("per_seed", [])})
    return [
        f"Every setting ran from the same {len(seeds)} seeds ({', '.join(map(str, seeds))}): "
        "seed *s* fixes the initial weights and the data order, identical for every strategy. "
        "*val loss*: mean of the seeds' final validation losses ± the half-width of the 95 % "
        "Student t interval of the mean (t quantile with N - 1 degrees of freedom times "
        "std / √N). *Δ vs fp32 / mixed*: the mean over seeds of (this strategy's loss - the "
        "baseline's loss with the same seed, same β2 and learning rate, or the baseline's "
        "best learning rate where it did not run at this one) ± its 95 % interval; "
        f"*significant?*: a two-sided paired t test at the {LEVEL} level (p shown). Pairing "
        "removes the seed's effect, which is shared; no correction is made for testing many "
        "strategies, so about one test in twenty is 'significant' by chance alone.",
        "",
    ]


def best_lr_section(records: list[dict[str, Any]]) -> list[str]:
    """Each strategy's best learning rate (lowest mean final validation loss), its loss
    there and, over seeds, its paired tests against the baselines at *their* best rates."""
    pooled = any("per_seed" in r for r in records)
    heads = "".join(f" | Δ vs {b} at its best | significant?" for b in BASELINES) if pooled \
        else ""
    lines = ["## Best learning rate", "",
             "Each strategy at the learning rate of its lowest mean final validation loss, "
             "so that it is compared at its own best setting, not only at fp32's.", "",
             f"| strategy | β2 | val loss at each lr | best lr | val loss there{heads} |",
             "|---|---|---|---|---|" + ("---|---|" * len(BASELINES) if pooled else "")]
    for best in (r for r in records if r.get("best_lr")):
        same = sorted((r for r in records if (r["strategy"], r["beta2"]) ==
                       (best["strategy"], best["beta2"])), key=lambda r: r["lr"])
        grid = ", ".join(f"{r['lr']:g}: {fmt(r['final_val_loss'])}" for r in same)
        edge = " (edge of the grid)" if len(same) > 1 and best in (same[0], same[-1]) else ""
        cells = [best["strategy"], f"{best['beta2']:g}", grid, f"{best['lr']:g}{edge}",
                 _loss(best)]
        if pooled:
            for name in BASELINES:
                cells += list(_paired(best.get(f"paired_vs_{name}_best")))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def pareto_section(records: list[dict[str, Any]]) -> list[str]:
    """Per beta2: bytes per parameter against loss, each strategy at its best learning
    rate, and whether it is on the Pareto front (judged on the means)."""
    lines = ["## Memory against loss (Pareto front)", "",
             "Each strategy at its best learning rate. *front*: no other strategy needs as few "
             "or fewer bytes per parameter for a lower mean loss (judged on the means; where "
             "intervals overlap, the data do not order the strategies).", "",
             "| β2 | strategy | B/param (model) | val loss (mean ± 95 % CI) | tokens/s | front |",
             "|---|---|---|---|---|---|"]
    for beta2 in sorted({r["beta2"] for r in records}):
        shown = sorted((r for r in records if r["beta2"] == beta2 and r.get("best_lr", True)),
                       key=lambda r: (r["bytes_per_param_model"], r["final_val_loss"]))
        front = {id(r) for r in pareto_front(shown)}
        for r in shown:
            lines.append(f"| {beta2:g} | {r['strategy']} | {r['bytes_per_param_model']} "
                         f"| {_loss(r)} | {fmt(r['tokens_per_s'], ',.0f')} "
                         f"| {'yes' if id(r) in front else ''} |")
    return lines + ["", "![pareto.png](pareto.png)", ""]


def per_seed_table(records: list[dict[str, Any]], swept: bool) -> list[str]:
    """Every seed's final validation loss (the values behind every mean and test)."""
    seeds = sorted({p["seed"] for r in records for p in r.get("per_seed", [])})
    lr = "lr | " if swept else ""
    lines = ["## Final validation loss per seed", "",
             f"| strategy | β2 | {lr}" + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + ("---|" if swept else "") + "---|" * len(seeds)]
    for r in records:
        values = {p["seed"]: p["final_val_loss"] for p in r["per_seed"]}
        cells = [r["strategy"], f"{r['beta2']:g}"] + ([f"{r['lr']:g}"] if swept else [])
        cells += [fmt(values.get(s)) for s in seeds]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]
