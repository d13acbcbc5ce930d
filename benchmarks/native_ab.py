"""A/B of two builds of the native library on the same AdamW step (#31).

For each strategy: GPT-like tensors of ``--size`` (``collage.bench.common.gpt_shapes``),
stepped three times by each build on copies of the same weights and states (the results
must be bit for bit equal, else the script stops), then ``collage_adamw_threads`` of each
build timed on the same tensors, interleaved (the order alternates every round), the ratio
taken per round. Builds are loaded with ctypes directly, so a library of an older ABI (the
"before" of an A/B) loads too.

    python benchmarks/native_ab.py BEFORE.so AFTER.so --size 16m --threads 1 --rounds 21
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from array import array
from itertools import chain

import torch

from collage.bench.common import gpt_shapes
from collage.optim import get_strategy
from collage.optim.native import calls
from collage.optim.rules import ADAMW

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, maximize=False)


def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.collage_adamw_threads.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.collage_adamw_threads.restype = ctypes.c_int
    return lib


def _tensors(strategy, size: str, seed: int = 0):
    """(params, states, grads): weights ~ N(0, 0.05), gradients ~ N(0, 1e-3), bf16."""
    gen = torch.Generator().manual_seed(seed)
    params, states, grads = [], [], []
    for _, shape in gpt_shapes(size):
        param = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
        state: dict = {}
        strategy.init_state(ADAMW, param, state)
        params.append(param)
        states.append(state)
        grads.append((torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16))
    return params, states, grads


def _table(strategy, params, states, grads) -> array:
    rows = [calls.table_row(calls.row_tensors(ADAMW, strategy, p, g, s), 0, 12345, 678)
            for p, g, s in zip(params, grads, states)]
    return array("q", chain.from_iterable(rows))


def _step(lib, strategy, table: array, count: int, step: int, threads: int) -> None:
    flags, h = calls.arguments(ADAMW.coefficients(HYPER, step), None, False, False)
    status = lib.collage_adamw_threads(strategy.native_code, flags, count,
                                       table.buffer_info()[0], h.buffer_info()[0], threads)
    if status != 0:
        raise RuntimeError(f"collage_adamw_threads returned {status}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same_bits(libs: dict, strategy, size: str, threads: int, steps: int = 3) -> None:
    """Each build steps its own copy of the same tensors; every stored bit must agree."""
    params, states, grads = _tensors(strategy, size)
    copies = {name: ([p.clone() for p in params],
                     [{k: v.clone() for k, v in s.items()} for s in states]) for name in libs}
    for step in range(1, steps + 1):
        for name, lib in libs.items():
            ps, ss = copies[name]
            _step(lib, strategy, _table(strategy, ps, ss, grads), len(ps), step, threads)
    (pa, sa), (pb, sb) = copies.values()
    for i, (a, b) in enumerate(zip(pa, pb)):
        if not torch.equal(_bits(a), _bits(b)):
            raise AssertionError(f"{strategy.name}: tensor {i} weight differs")
    for i, (a, b) in enumerate(zip(sa, sb)):
        for key in a:
            if key != "step" and not torch.equal(_bits(a[key]), _bits(b[key])):
                raise AssertionError(f"{strategy.name}: tensor {i} {key} differs")


def timings(libs: dict, strategy, size: str, threads: int, rounds: int) -> dict:
    """Median ms per build and the median per-round ratio before / after."""
    params, states, grads = _tensors(strategy, size)
    table = _table(strategy, params, states, grads)
    names = list(libs)
    # CPU time of this thread beside wall time: on one thread it leaves out the time the
    # thread waits descheduled on a shared machine
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, start_cpu = time.perf_counter(), time.thread_time()
            _step(libs[name], strategy, table, len(params), 5, threads)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    ratios = [b / a for b, a in zip(times[names[0]], times[names[1]])]
    cpu_ratios = [b / a for b, a in zip(cpu[names[0]], cpu[names[1]])]
    return {"params": sum(p.numel() for p in params),
            **{name: statistics.median(v) * 1e3 for name, v in times.items()},
            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
            "cpu_ratio": statistics.median(cpu_ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--size", default="16m")
    parser.add_argument("--strategies", default="light,plus,split,kahan,bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"before": _library(args.before), "after": _library(args.after)}
    print("| strategy | params | same bits | before ms | after ms | before / after (per "
          "round, median) | range | before / after, thread CPU time |")
    print("|---|---:|---|---:|---:|---:|---|---:|")
    for name in args.strategies.split(","):
        strategy = get_strategy(name)
        same_bits(libs, strategy, args.size, args.threads)
        t = timings(libs, strategy, args.size, args.threads, args.rounds)
        lo, hi = t["ratio_range"]
        print(f"| {name} | {t['params'] / 1e6:.1f}M | yes (3 steps) | {t['before']:.2f} | "
              f"{t['after']:.2f} | {t['ratio']:.3f} | {lo:.2f}-{hi:.2f} | "
              f"{t['cpu_ratio']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
