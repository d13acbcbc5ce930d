"""The GPU goals (issue #21, docs/gpu.md) read off ``benchmarks/gpu_check.sh``'s results.

Usage: ``python benchmarks/gpu_goals.py OUT`` prints a markdown table of each goal, the
value measured and whether it holds; a goal whose result file is missing or lacks the row
is "not measured", never estimated. Reads ``OUT/bench_optimizer.json`` and
``OUT/bench_train.json``.
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


def goals(optimizer: dict | None, train: dict | None) -> list[dict]:
    """Each goal with its measured value (the worst over the sizes it applies to)."""
    out = []
    large = _fused_rows(optimizer, LARGE)
    for strategy, target in SPEEDUPS:
        values = [r["speedup_vs_torch_fused"] for r in large if r["strategy"] == strategy]
        out.append(_goal(f"{strategy} step speed vs torch fused AdamW fp32 (100M+)",
                         min(values) if values else None, target, True, "x"))
    by_strategy: dict[str, list[float]] = {}
    for row in large:
        by_strategy.setdefault(row["strategy"], []).append(row["roofline_fraction"])
    for strategy, fractions in by_strategy.items():
        out.append(_goal(f"{strategy} fraction of the HBM roofline (100M+)", min(fractions),
                         ROOFLINE, True))
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
    lines = [f"# GPU goals ({where})", "", "| goal | measured | target | holds |",
             "|---|---:|---:|---|"]
    for row in rows:
        if row["value"] is None:
            measured, holds = "not measured", "not measured"
        else:
            measured = f"{row['value']:.3g}{row.get('unit', '')}"
            holds = "yes" if row["holds"] else "**no**"
        sign = ">=" if "memory" not in row["goal"] and "first step" not in row["goal"] else "<="
        lines.append(f"| {row['goal']} | {measured} | {sign} {row['target']:g} | {holds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_goals.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    optimizer = _load(out / "bench_optimizer.json")
    train = _load(out / "bench_train.json")
    where = (optimizer or train or {}).get("environment", {}).get("gpu", "no GPU result")
    print(markdown(goals(optimizer, train), where), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
