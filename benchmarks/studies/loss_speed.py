"""The harness's loss against the usual ``F.cross_entropy(logits.float(), y)`` recipe: the
time of forward and backward on bf16 logits, interleaved, median and range of the ratios.

Usage: ``python benchmarks/studies/loss_speed.py [--runs 7]`` (docs/compare.md quotes its output)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from collage.train.losses import cross_entropy

SHAPES = ((2048, 257), (1024, 50257))


def _time(loss_fn, logits: torch.Tensor, target: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        x = logits.detach().requires_grad_()
        start = time.perf_counter()
        loss_fn(x, target).backward()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="interleaved runs (default 7)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per run, best kept")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    for rows, classes in SHAPES:
        logits = (torch.randn(rows, classes, generator=g) * 3).to(torch.bfloat16)
        target = torch.randint(0, classes, (rows,), generator=g)
        ratios = []
        for _ in range(args.runs):
            ours = _time(cross_entropy, logits, target, args.repeats)
            theirs = _time(lambda x, y: F.cross_entropy(x.float(), y), logits, target,
                           args.repeats)
            ratios.append(ours / theirs)
        print(f"({rows}, {classes}): cross_entropy / .float() recipe: median "
              f"{statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x "
              f"({args.runs} interleaved runs, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
