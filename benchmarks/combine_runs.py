"""Combine several ``collage bench optimizer --json`` runs into the markdown tables of
``docs/benchmarks``: per size, each row's median ns/param and roofline fraction over the
runs, its same-run speed-up against torch's fused AdamW in every run, and their median.

Why medians of same-run ratios: this shared machine's bandwidth moves by tens of percent
between runs, so absolute times of different runs are not comparable, while a ratio
measured within one run (candidate and baseline interleaved) is.

Usage::

    python benchmarks/combine_runs.py run1.json run2.json run3.json > tables.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}"


def combine(runs: list[dict]) -> str:
    """The markdown tables of ``runs`` (parsed JSON reports of the same sizes and rows),
    after the load each run started under (its ``load``, where it recorded one)."""
    lines: list[str] = []
    loads = [run.get("load") for run in runs]
    if any(loads):
        lines += ["1-minute load average before each run: " + ", ".join(
            "not recorded" if not load or load.get("before") is None else
            f"{load['before'][0]:.2f}" + (" (busy: times not the machine's)"
                                          if load.get("busy") else "")
            for load in loads), ""]
    for index, first in enumerate(runs[0]["sizes"]):
        sizes = [run["sizes"][index] for run in runs]
        if any(s["size"] != first["size"] for s in sizes):
            raise ValueError(f"runs differ in their sizes at position {index}")
        bandwidth = ", ".join(f"{s['copy_GBps']:.0f} / {s['add_GBps']:.0f}" for s in sizes)
        lines += [f"#### {first['size']}: {first['n_params'] / 1e6:.2f}M parameters, "
                  f"{first['n_tensors']} tensors; copy / in-place add bandwidth per run: "
                  f"{bandwidth} GB/s", "",
                  "| optimizer | B/param | ns/param (median of runs) | roofline | "
                  "x torch fused, per run | median | x torch fused (CPU time), median |",
                  "|---|---:|---:|---:|---|---:|---:|"]
        for row in first["rows"]:
            same = [next((r for r in s["rows"] if r["label"] == row["label"]), None)
                    for s in sizes]
            if any(r is None for r in same):
                continue  # a row missing from some run (an optional baseline)
            speedups = [r["speedup_vs_torch_fused"] for r in same]
            cpu = [r.get("speedup_vs_torch_fused_cpu") or r["speedup_vs_torch_fused"]
                   for r in same]
            ns = statistics.median(r["ns_per_param"]["median"] for r in same)
            roof = statistics.median(r["roofline_fraction"] for r in same)
            lines.append(
                f"| {row['label']} | {row['bytes_per_param']} | {_fmt(ns)} | {roof:.0%} | "
                f"{' / '.join(f'{x:.2f}' for x in speedups)} | "
                f"**{statistics.median(speedups):.2f}** | {statistics.median(cpu):.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files of collage bench optimizer --json")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as handle:
            runs.append(json.load(handle))
    sys.stdout.write(combine(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
