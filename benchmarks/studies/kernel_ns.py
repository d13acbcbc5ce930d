"""Nanoseconds per element and core of one strategy's CPU step on one tensor: the native
kernels' arithmetic and memory traffic, without the non-finite check
(``nonfinite="ignore"``); compare with the divider's floor (``benchmarks/studies/divider_probe.c``)
and the streams' (``benchmarks/studies/stream_probe.c``). Issue #31:
docs/benchmarks/intel-xeon-2c_2026-12-05_prefetch.md (``--elements 32768`` keeps the data
in L2, where the step's Python is a larger part of the time).

Usage:
    python benchmarks/studies/kernel_ns.py STRATEGY [--elements 16e6] [--threads 1] [--seconds 4]
        [--start-step N]

``--start-step 20000``: the steps after step 20,000, where the bias correction of the second
moment is 1 (beta2 = 0.999) and the native kernels skip its division: the division's cost.

Prints the median step time x threads / elements, in ns.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import collage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("strategy")
    parser.add_argument("--elements", type=float, default=16e6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--start-step", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = int(args.elements)
    dtype = torch.float32 if args.strategy == "fp32" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype))
    param.grad = (torch.randn(n, generator=generator) * 1e-3).to(dtype)
    opt = collage.AdamW([param], lr=1e-4, strategy=args.strategy, nonfinite="ignore")
    for _ in range(3):  # the library built, the plan made
        opt.step()
    if args.start_step:
        with torch.no_grad():
            opt.state[param]["step"].fill_(args.start_step)
        opt.step()  # the plan rebuilt from the counters now
    times = []
    stop = time.perf_counter() + args.seconds
    while time.perf_counter() < stop:
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    print(f"{args.strategy}: {median * args.threads / n * 1e9:.3f} ns per element and core "
          f"({n} elements, {args.threads} thread(s), {len(times)} steps from step "
          f"{args.start_step}, path {opt.last_paths[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
