"""Tune the Triton kernels' launch shape on one GPU: elements per program (``BLOCK``),
warps per program and persistent programs per multiprocessor (``PROGRAMS_PER_SM``: more
than fit at once leave the late ones waiting for the first to finish; ``gpu_model.py``
gives each variant's registers), for a few strategies at two sizes, beside torch's fused
AdamW.

Each (block, warps, programs) setting times ``--steps`` AdamW steps (``nonfinite="ignore"``: the
kernels alone) with CUDA events after warm-up steps, median per step; prints a table and
the setting with the lowest geometric mean over the strategies at the largest size, and
writes the numbers as JSON when ``--json PATH`` is given. docs/gpu.md quotes it.

Usage: ``python benchmarks/studies/triton_tune.py [--sizes 100m,1b] [--json out.json]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import torch

import collage
from collage.bench.common import gpt_shapes
from collage.bench.measure import make_params
from collage.optim import get_strategy
from collage.optim.triton import launch

SETTINGS = list(itertools.product((1024, 2048), (4, 8), (2, 4)))
STRATEGIES = ("fp32", "bf16", "light", "plus")


def _time(make, size: str, dtype: torch.dtype, steps: int) -> float:
    # the bench's parameters and gradients, drawn on the GPU
    params = make_params(gpt_shapes(size), dtype, torch.device("cuda"), seed=0)
    opt = make(params)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    del opt, params
    torch.cuda.empty_cache()
    return statistics.median(times)


def _collage(strategy: str):
    return lambda params: collage.AdamW(params, lr=1e-3, strategy=strategy,
                                        nonfinite="ignore")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100m,1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    results: dict = {"settings": {}, "torch_fused_fp32_ms": {}}
    for size in sizes:
        results["torch_fused_fp32_ms"][size] = _time(
            lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), size, torch.float32,
            args.steps)
    for block, warps, programs in SETTINGS:
        launch.GPU_BLOCK, launch.GPU_WARPS, launch.PROGRAMS_PER_SM = block, warps, programs
        row = {}
        for size in sizes:
            for strategy in STRATEGIES:
                dtype = get_strategy(strategy).weight_dtypes[0]
                row[f"{strategy}@{size}"] = _time(_collage(strategy), size, dtype, args.steps)
        results["settings"][f"{block}x{warps}x{programs}"] = row
        print(f"BLOCK {block:5d} warps {warps} programs/SM {programs}: " + "  ".join(
            f"{k} {v:.3f} ms" for k, v in row.items()), flush=True)
    largest = sizes[-1]
    score = {name: math.exp(statistics.mean(math.log(row[f"{s}@{largest}"])
                                            for s in STRATEGIES))
             for name, row in results["settings"].items()}
    best = min(score, key=score.get)
    results["best"] = best
    print(f"torch fused fp32: {results['torch_fused_fp32_ms']}")
    print(f"best at {largest}: {best} (geometric mean {score[best]:.3f} ms)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
