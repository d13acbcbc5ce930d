"""Cost of lost-update tracking: optimizer step time with ``track_updates`` off and on.

Same run, same parameter sizes, tracked and untracked steps interleaved, medians of repeats
after warm-up; prints the ratio tracked / untracked per strategy for the fused and foreach
paths. The issue's target: a measured fused step costs at most 1.5x an unmeasured one.

On CPU the fused rows compare the native kernels with themselves: the unmeasured native
step (``collage_adamw``) and the native measured step (``collage_adamw_measured``); each
row records the path both optimizers ran (``optimizer.last_paths``: ``native``, or
``compiled`` where the native kernels are unavailable or do not cover the strategy).
``--backend compiled`` switches the native kernels off to measure the compiled (inductor)
kernels instead.

Usage: ``python benchmarks/bench_metrics.py [--numel 4000000] [--repeats 15]
[--strategies ...] [--paths fused foreach] [--backend native|compiled] [--threads 1]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import collage
from collage.optim import get_strategy, native


_STRATEGIES = ("fp32", "bf16", "stochastic", "mixed", "split", "kahan", "light", "plus")
_PATHS = {"fused": {"fused": True}, "foreach": {"foreach": True}}


def _params(numel: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """A GPT-like mix: square and 4x matrices plus vectors, about ``numel`` elements."""
    d = max(64, int((numel / 12.5) ** 0.5))
    shapes = [(d, d), (d, 3 * d), (d, 4 * d), (4 * d, d), (d,), (d,), (4 * d,)]
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float32).mul_(0.02).to(dtype))
            for s in shapes]


def _make(strategy: str, path: dict, track: bool, numel: int) -> collage.AdamW:
    dtype = get_strategy(strategy).weight_dtypes[0]
    params = _params(numel, dtype)
    opt = collage.AdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3,
                        strategy=strategy, track_updates=track, **path)
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-3)
    for _ in range(3):  # warm-up, compilation
        opt.step()
    return opt


def _timed_step(opt: collage.AdamW) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def _time_pair(strategy: str, path: dict, numel: int, repeats: int) -> dict:
    """Median step times (untracked, tracked), measured interleaved so that load changes on
    this shared machine hit both alike; the ratio is the median of per-pair ratios, p90 of
    each beside it; the backend each optimizer ran."""
    plain, measured = _make(strategy, path, False, numel), _make(strategy, path, True, numel)
    off, on, ratios = [], [], []
    for _ in range(repeats):
        a, b = _timed_step(plain), _timed_step(measured)
        off.append(a)
        on.append(b)
        ratios.append(b / a)
    return {"untracked_ms": statistics.median(off) * 1e3, "tracked_ms": statistics.median(on) * 1e3,
            "untracked_p90_ms": _p90(off) * 1e3, "tracked_p90_ms": _p90(on) * 1e3,
            "ratio": statistics.median(ratios), "ratio_p90": _p90(ratios),
            "backend_untracked": _path_ran(plain), "backend_tracked": _path_ran(measured)}


def _path_ran(opt: collage.AdamW) -> str:
    """The path(s) the optimizer's last step ran."""
    return "+".join(dict.fromkeys(opt.last_paths.values()))


def _cpu() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and its logical CPU count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            name = next(line.split(":", 1)[1].strip() for line in handle
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} logical CPUs"


def _p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, round(0.9 * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--strategies", nargs="+", default=list(_STRATEGIES))
    parser.add_argument("--paths", nargs="+", default=list(_PATHS), choices=list(_PATHS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: OpenMP waits badly on a loaded 2-core machine)")
    parser.add_argument("--backend", choices=("native", "compiled"), default="native",
                        help="CPU fused kernels: native C (default) or compiled (inductor; "
                             "native off)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.backend == "compiled":
        native.covers = lambda *a, **k: False  # this process only
    rows = []
    for strategy in args.strategies:
        for path_name in args.paths:
            path = _PATHS[path_name]
            row = {"strategy": strategy, "path": path_name,
                   **_time_pair(strategy, path, args.numel, args.repeats)}
            rows.append(row)
            backend = "" if path_name != "fused" else \
                f"  [{row['backend_untracked']} / {row['backend_tracked']}]"
            print(f"{strategy:10s} {path_name:8s} untracked {row['untracked_ms']:8.2f} ms  "
                  f"tracked {row['tracked_ms']:8.2f} ms  ratio {row['ratio']:5.2f}x "
                  f"(p90 {row['ratio_p90']:4.2f}x){backend}", flush=True)
    if args.json:
        meta = {"torch": torch.__version__, "collage": collage.__version__,
                "python": platform.python_version(),
                "machine": _cpu(),
                "native": native.info() if args.backend == "native" else None,
                "threads": torch.get_num_threads(), "numel": args.numel,
                "repeats": args.repeats, "load_average": list(os.getloadavg()),
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
