"""The GPU goals (issue #21, docs/gpu.md) read off ``benchmarks/gpu_check.sh``'s results.

Usage: ``python benchmarks/gpu_goals.py OUT`` prints a markdown table of each goal, the
value measured and whether it holds; a goal whose result file is missing or lacks the row
is "not measured", never estimated. Reads ``OUT/bench_optimizer.json`` and
``OUT/bench_train.json``; beside each step-speed and roofline goal, the model's prediction
for the same kernels (``OUT/gpu_model.json``, ``benchmarks/gpu_model.py``), so that a run
recalibrates the model ("not modelled" where that file is missing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: sizes where the speed goals apply (100M parameters and more)
LARGE = ("100m", "1b")
#: (strategy, least speed-up over torch.optim.AdamW(fused=True) on fp32 weights)
SPEEDUPS = (("light", 1.5), ("plus", 1.25))
ROOFLINE = 0.85
FIRST_STEP_S = 10.0
TRAIN_SPEED, TRAIN_MEMORY = 1.0, 0.8


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fused_rows(optimizer: dict | None, sizes=None) -> list[dict]:
    """The collage fused rows in the default configuration (``nonfinite="skip"``; not the
    ``+ignore`` rows without the check) of ``sizes`` (all: None)."""
    if optimizer is None:
        return []
    return [row for block in optimizer.get("sizes", [])
            if sizes is None or block["size"] in sizes
            for row in block["rows"]
            if row.get("path") == "fused" and "+" not in row["key"]]


def _goal(name: str, value: float | None, target: float, at_least: bool,
          unit: str = "") -> dict:
    if value is None:
        return {"goal": name, "value": None, "target": target, "holds": None}
    holds = value >= target if at_least else value <= target
    return {"goal": name, "value": value, "target": target, "holds": holds, "unit": unit}


def _modelled(model: list[dict] | None, strategy: str) -> dict | None:
    """The model's row of ``strategy``'s AdamW whole-block kernel in the default
    configuration."""
    for row in model or []:
        if (row.get("rule"), row.get("strategy"), row.get("configuration"),
                row.get("variant")) == ("adamw", strategy, "default", "whole"):
            return row
    return None


def _torch_modelled(model: list[dict] | None) -> dict | None:
    """The calibration row standing for torch's fused AdamW (float32, IEEE sqrt/div)."""
    return next((r for r in model or [] if r.get("strategy") == "plain fp32 AdamW"), None)


def predicted_fraction(model: list[dict] | None, strategy: str) -> float | None:
    """The model's fraction of the bandwidth, the worse of 100M and 1B."""
    row = _modelled(model, strategy)
    return None if row is None else min(row["predicted_100m"], row["predicted_1b"])


def predicted_speedup(model: list[dict] | None, strategy: str,
                      host_hidden: bool = False) -> float | None:
    """The model's speed-up over torch's fused AdamW on fp32 weights: the time per element
    is bytes / fraction, torch's from the calibration kernel (28 bytes), the worse size;
    ``host_hidden``: the 100M step with the host's time run while the device works (a
    loop of steps), else added to it (an isolated step)."""
    ours, torch_row = _modelled(model, strategy), _torch_modelled(model)
    if ours is None or torch_row is None:
        return None
    torch_time = torch_row["bytes_per_element"] / torch_row["predicted_1b"]
    hundred = "predicted_100m_host_hidden" if host_hidden else "predicted_100m"
    return min(torch_time * ours.get(key, ours["predicted_100m"]) / ours["bytes_per_element"]
               for key in (hundred, "predicted_1b"))


def goals(optimizer: dict | None, train: dict | None,
          model: list[dict] | None = None) -> list[dict]:
    """Each goal with its measured value (the worst over the sizes it applies to) and, for
    the step's, the model's prediction."""
    out = []
    large = _fused_rows(optimizer, LARGE)
    for strategy, target in SPEEDUPS:
        values = [r["speedup_vs_torch_fused"] for r in large if r["strategy"] == strategy]
        out.append(_goal(f"{strategy} step speed vs torch fused AdamW fp32 (100M+)",
                         min(values) if values else None, target, True, "x"))
        out[-1]["predicted"] = predicted_speedup(model, strategy)
        # the same in a loop of steps (one synchronisation per LOOP_STEPS, as training
        # runs them: the host prepares the next step while the device runs this one);
        # measured on CUDA only (``collage.bench.measure._looped``)
        looped = [r["loop_speedup_vs_torch_fused"] for r in large
                  if r["strategy"] == strategy and "loop_speedup_vs_torch_fused" in r]
        out.append(_goal(f"{strategy} step speed vs torch fused AdamW fp32 (100M+), steps "
                         "in a loop", min(looped) if looped else None, target, True, "x"))
        out[-1]["predicted"] = predicted_speedup(model, strategy, host_hidden=True)
    by_strategy: dict[str, list[float]] = {}
    for row in large:
        by_strategy.setdefault(row["strategy"], []).append(row["roofline_fraction"])
    for strategy, fractions in by_strategy.items():
        out.append(_goal(f"{strategy} fraction of the HBM roofline (100M+)", min(fractions),
                         ROOFLINE, True))
        out[-1]["predicted"] = predicted_fraction(model, strategy)
    if not by_strategy:
        out.append(_goal("every strategy's fraction of the HBM roofline (100M+)", None,
                         ROOFLINE, True))
    firsts = [r["first_step_s"] for r in _fused_rows(optimizer) if "first_step_s" in r]
    out.append(_goal("first step, kernels compiled (s)", max(firsts) if firsts else None,
                     FIRST_STEP_S, False, "s"))
    rows = {r["mode"]: r for r in (train or {}).get("rows", [])}
    plus = rows.get("plus", {})
    out.append(_goal("train: plus tokens/s vs autocast fp32 weights",
                     plus.get("tokens_per_s_vs_autocast"), TRAIN_SPEED, True, "x"))
    out.append(_goal("train: plus peak memory vs autocast", plus.get("peak_vs_autocast"),
                     TRAIN_MEMORY, False, "x"))
    return out


def markdown(rows: list[dict], where: str) -> str:
    lines = [f"# GPU goals ({where})", "",
             "| goal | measured | model (benchmarks/gpu_model.py) | target | holds |",
             "|---|---:|---:|---:|---|"]
    for row in rows:
        if row["value"] is None:
            measured, holds = "not measured", "not measured"
        else:
            measured = f"{row['value']:.3g}{row.get('unit', '')}"
            holds = "yes" if row["holds"] else "**no**"
        sign = ">=" if "memory" not in row["goal"] and "first step" not in row["goal"] else "<="
        if "predicted" not in row:
            model = "-"
        elif row["predicted"] is None:
            model = "not modelled"
        else:
            model = f"{row['predicted']:.3g}{row.get('unit', '')}"
        lines.append(f"| {row['goal']} | {measured} | {model} | {sign} {row['target']:g} "
                     f"| {holds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_goals.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    optimizer = _load(out / "bench_optimizer.json")
    train = _load(out / "bench_train.json")
    model = _load(out / "gpu_model.json")
    where = (optimizer or train or {}).get("environment", {}).get("gpu", "no GPU result")
    print(markdown(goals(optimizer, train, model), where), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
