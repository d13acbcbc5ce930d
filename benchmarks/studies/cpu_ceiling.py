"""How fast the CPU step of each bf16-weight strategy can be on this machine, against
torch's fused AdamW, from two measurements: each strategy's arithmetic per element on one
core (the native kernel alone, data in L2 or L3, where memory plays no part) and the bench's
runs (torch's step and the bandwidth, measured in the same rounds). Issue #40's
goals are ratios at 17M and 111M parameters on two threads, and on one; this says which of
them the kernels' arithmetic allows at all.

The ceiling (a lower bound on the step's time per parameter on N threads):

    max(A / N, step bytes / BW) + check bytes / BW

A the arithmetic in ns per element on one core, split perfectly between the cores; the
step's bytes over the bandwidth (it cannot be faster than its traffic); then the default
non-finite check, which reads every gradient once before any write (2 bytes per parameter
with bf16 gradients) and so cannot overlap the step. Host time and imperfect overlap are
left out, so every real run is slower. Torch's time over the ceiling is the best ratio the
kernels as they are can reach; ``A needed`` is the arithmetic per core a goal asks for.

    python benchmarks/studies/cpu_ceiling.py 'docs/benchmarks/MACHINE_ceiling-*t-run*.json'
        [--core 'docs/benchmarks/MACHINE_ceiling-core-run*.txt'] [--measure]

``--measure`` times the arithmetic now (one thread, rows of 8K-1M elements, least of 7
rounds, the call's own cost subtracted) and prints it in the ``--core`` files' format.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import time
from array import array

import torch

from collage.optim import get_strategy
from collage.optim.native import build, calls
from collage.optim.rules import ADAMW

#: #40's goals (x torch's fused AdamW, two threads, 17M and 111M parameters)
GOALS = {"bf16": 1.5, "stochastic": 1.4, "light": 1.3, "kahan": 1.2, "split": 1.1, "plus": 1.1}
SIZES = (8192, 65536, 1 << 20)
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, maximize=False)


def _row_table(strategy, n: int) -> tuple[array, tuple]:
    """One row of ``n`` elements (weights ~ N(0, 0.05), gradients ~ N(0, 1e-3)), and the
    tensors that must outlive the table."""
    gen = torch.Generator().manual_seed(0)
    param = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
    state: dict = {}
    strategy.init_state(ADAMW, param, state)
    grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    row = calls.table_row(calls.row_tensors(ADAMW, strategy, param, grad, state), 0, 12345, 678)
    return array("q", row), (param, state, grad)


def _seconds_per_call(lib, strategy, table: array, n: int) -> float:
    flags, h = calls.arguments(ADAMW.coefficients(HYPER, 5), None, False, False)
    reps = max(3, int(2e6 // n))
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            calls.call_threads(lib, strategy.native_code, flags, 1, table, h, 1)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def measure(names: list[str]) -> None:
    """Per strategy, ns per element on one core at each of SIZES (the cost of a call on
    32 elements subtracted), printed as ``name size:ns ...``."""
    torch.set_num_threads(1)
    lib = build.load()
    if lib is None:
        sys.exit("the native library did not load: nothing to measure")
    for name in names:
        strategy = get_strategy(name)
        table, _kept = _row_table(strategy, 32)
        call = _seconds_per_call(lib, strategy, table, 32)
        cells = []
        for n in SIZES:
            table, _kept = _row_table(strategy, n)  # (the tensors the table points into)
            cells.append(f"{n}:{(_seconds_per_call(lib, strategy, table, n) - call) / n * 1e9:.3f}")
        print(name, *cells, flush=True)


def arithmetic(paths: list[str]) -> dict[str, float]:
    """ns per element on one core: per file the least over the rows in L3 (65536 and 1M
    elements: noise only adds time), then the median over files."""
    per: dict[str, list[float]] = {}
    for path in paths:
        with open(path) as handle:
            for line in handle:
                name, *cells = line.split()
                values = dict(cell.split(":") for cell in cells if ":" in cell)
                per.setdefault(name, []).append(min(float(values["65536"]),
                                                    float(values["1048576"])))
    return {name: statistics.median(v) for name, v in per.items()}


def ceiling(runs: list[dict], size: str, A: dict[str, float]) -> list[str]:
    """The table of ``size`` from ``runs`` (all on one thread count)."""
    threads = runs[0]["environment"]["threads"]
    # per strategy: the speed-ups, and the bytes per parameter of the step and of its check
    # as the bench derives them from the strategy (``bytes_per_param``, the check's read
    # included, and ``check_bytes_per_param``)
    torch_ns, bandwidth, measured, step_bytes, check_bytes = [], [], {}, {}, {}
    for run in runs:
        entry = next(s for s in run["sizes"] if s["size"] == size)
        bandwidth.append(max(entry["copy_GBps"], entry["add_GBps"]))
        for row in entry["rows"]:
            if row["strategy"] is None:
                torch_ns.append(row["ns_per_param"]["median"])
            elif row.get("nonfinite") == "skip":
                name = row["strategy"]
                measured.setdefault(name, []).append(row["speedup_vs_torch_fused"])
                check_bytes[name] = row["check_bytes_per_param"]
                step_bytes[name] = row["bytes_per_param"] - check_bytes[name]
    T, BW = statistics.median(torch_ns), statistics.median(bandwidth)
    lines = [f"### {size}, {threads} thread(s): torch fused {T:.3f} ns/param, bandwidth "
             f"{BW:.1f} GB/s ({len(runs)} run(s))", "",
             "| strategy | A (ns/elem, one core) | bytes bound | ceiling | measured (median) "
             "| goal | A needed | change needed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, goal in GOALS.items():
        check = check_bytes[name] / BW
        best = max(A[name] / threads, step_bytes[name] / BW) + check
        bytes_bound = T / (step_bytes[name] / BW + check)
        needed = threads * (T / goal - check)
        lines.append(f"| `{name}` | {A[name]:.3f} | {bytes_bound:.2f}x | {T / best:.2f}x | "
                     f"{statistics.median(measured[name]):.2f}x | {goal}x | {needed:.3f} | "
                     f"{(needed / A[name] - 1) * 100:+.0f} % |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="?", help="glob of the bench's --json files")
    parser.add_argument("--core", help="glob of --measure outputs")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--strategies", default=",".join(GOALS))
    args = parser.parse_args(argv)
    if args.measure:
        measure(args.strategies.split(","))
        return 0
    if not args.runs or not args.core:
        parser.error("give the bench runs and --core, or --measure")
    runs = [json.load(open(path)) for path in sorted(glob.glob(args.runs))]
    A = arithmetic(sorted(glob.glob(args.core)))
    for threads in sorted({run["environment"]["threads"] for run in runs}, reverse=True):
        alike = [run for run in runs if run["environment"]["threads"] == threads]
        for size in ("16m", "100m"):
            print("\n".join(ceiling(alike, size, A)), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
