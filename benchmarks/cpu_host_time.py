"""The host (Python) time of a CPU step on its native plan, with the C call stubbed, for the
source tree at TREE: what a small model's step pays besides its arithmetic (issues #31,
#40). Run once per tree, interleaved, to compare two commits on one machine:

    git worktree add /tmp/before <commit>
    for i in 1 2 3 4 5 6; do for t in /tmp/before .; do
        python benchmarks/cpu_host_time.py $t; done; done

Each run: the ``--size`` layout's tensors (``collage.bench.common.gpt_shapes``; ``small``:
28 tensors, 0.17M parameters), bf16 weights with gradients, ``collage.AdamW`` in the
default configuration (``fused=None``: the native plan, the non-finite check on); 20 real
steps, then ``collage_adamw_planned`` replaced by a stub that reports "stepped" without
reading anything, then ``--steps`` steps timed one by one. Prints one JSON line per
strategy: the median and the 10th and 90th percentiles, in microseconds. ``--zero-grad``:
``opt.zero_grad()`` timed instead, the gradients set again (untimed) before each call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


class _StubbedCall:
    """A plan's library with its one step call stubbed: 0, "stepped", nothing read."""

    def __init__(self, lib) -> None:
        self._lib = lib

    def __getattr__(self, name: str):
        if name == "collage_adamw_planned":
            return lambda *args: 0
        return getattr(self._lib, name)


def _host_times(strategy: str, size: str, steps: int, zero_grad: bool) -> list[float]:
    import collage  # noqa: PLC0415 - the tree's, after main() set the path
    import torch  # noqa: PLC0415
    from collage.bench.common import gpt_shapes  # noqa: PLC0415

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(
        torch.bfloat16)) for _, shape in gpt_shapes(size)]
    for param in params:
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(torch.bfloat16)
    opt = collage.AdamW(params, lr=1e-3, strategy=strategy)
    for _ in range(20):
        opt.step()
    plans = [book.cache.get("native_plan") for book in opt._books.values()]
    if not plans or None in plans:
        raise SystemExit(f"{strategy}: no native plan after 20 steps (paths {opt.last_paths})")
    for plan in plans:
        plan.lib = _StubbedCall(plan.lib)
    grads = [param.grad for param in params]
    times = []
    for _ in range(steps):
        if zero_grad:
            for param, grad in zip(params, grads):
                param.grad = grad
        started = time.perf_counter()
        opt.zero_grad() if zero_grad else opt.step()
        times.append((time.perf_counter() - started) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", help="the repository checkout to measure")
    parser.add_argument("--size", default="small")
    parser.add_argument("--strategies", default="bf16,light,plus")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--zero-grad", action="store_true",
                        help="time opt.zero_grad() instead of the step")
    args = parser.parse_args(argv)
    tree = Path(args.tree).resolve()
    sys.path[:0] = [str(tree / "src")]
    import collage  # noqa: PLC0415
    import torch  # noqa: PLC0415

    if not Path(collage.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"imported collage from {collage.__file__}, not {tree}")
    torch.set_num_threads(args.threads)
    for strategy in args.strategies.split(","):
        times = _host_times(strategy, args.size, args.steps, args.zero_grad)
        deciles = statistics.quantiles(times, n=10)
        print(json.dumps({"tree": str(tree), "strategy": strategy, "size": args.size,
                          "timed": "zero_grad" if args.zero_grad else "step",
                          "median_us": round(statistics.median(times), 1),
                          "p10_us": round(deciles[0], 1), "p90_us": round(deciles[-1], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
