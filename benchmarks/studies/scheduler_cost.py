"""What a learning-rate scheduler adds to a step's host time (#31): one AdamW over TENSORS
small bf16 tensors (the native kernel call stubbed, so that only the host's work is timed),
stepped with and without ``CosineAnnealingLR`` setting a new learning rate after each step,
beside torch's fused AdamW on float32 tensors the same way. Thread CPU time of
``opt.step()`` alone, median of ``--steps``.

    python benchmarks/studies/scheduler_cost.py --tensors 28,148 --strategy plus

Run it once per source tree to compare two commits (``PYTHONPATH=TREE/src``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import collage
from collage.optim.native import calls


def _median_step_us(opt: torch.optim.Optimizer, scheduled: bool, steps: int) -> float:
    scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10**6) if scheduled
                 else None)
    times = []
    for index in range(steps + 30):
        start = time.thread_time()
        opt.step()
        if index >= 30:  # after the plans are made
            times.append(time.thread_time() - start)
        if scheduler is not None:
            scheduler.step()
    return 1e6 * statistics.median(times)


def _params(count: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros(64, dtype=dtype)) for _ in range(count)]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def measure(tensors: int, strategy: str, steps: int) -> dict:
    out: dict = {"tensors": tensors, "strategy": strategy}
    for scheduled in (False, True):
        label = "scheduled" if scheduled else "plain"
        opt = collage.AdamW(_params(tensors, torch.bfloat16), lr=1e-4, strategy=strategy)
        out[f"collage_{label}_us"] = _median_step_us(opt, scheduled, steps)
        torch_opt = torch.optim.AdamW(_params(tensors, torch.float32), lr=1e-4, fused=True)
        out[f"torch_fused_{label}_us"] = _median_step_us(torch_opt, scheduled, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", default="28,148")
    parser.add_argument("--strategy", default="plus")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args(argv)
    calls.call_threads = lambda *a, **k: None  # the host's work only
    print("| tensors | collage, no scheduler (us) | with a scheduler | added | torch fused, "
          "no scheduler | with a scheduler | added |")
    print("|---|---|---|---|---|---|---|")
    for count in (int(n) for n in args.tensors.split(",")):
        r = measure(count, args.strategy, args.steps)
        print(f"| {count} | {r['collage_plain_us']:.1f} | {r['collage_scheduled_us']:.1f} | "
              f"{r['collage_scheduled_us'] - r['collage_plain_us']:.1f} | "
              f"{r['torch_fused_plain_us']:.1f} | {r['torch_fused_scheduled_us']:.1f} | "
              f"{r['torch_fused_scheduled_us'] - r['torch_fused_plain_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
