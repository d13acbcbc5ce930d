"""``collage bench``: performance benchmarks.

* ``collage bench optimizer``: AdamW step time per strategy and path (fused, foreach,
  reference) on GPT-like parameter sets, against the memory roofline and against
  ``torch.optim.AdamW``, optimi (Kahan summation) and torchao (bf16 stochastic rounding);
* ``collage bench train``: tokens/s and peak memory of a GPT per strategy, beside
  ``torch.autocast(bfloat16)`` with float32 weights.

Results: ``docs/benchmarks/``.
"""

from __future__ import annotations

import argparse

from . import optimizer, train

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark optimizer steps and training throughput",
        description="Benchmarks: `collage bench optimizer` (step time, GB/s, roofline, vs "
                    "torch.optim/optimi/torchao) and `collage bench train` (tokens/s, peak "
                    "memory per strategy vs autocast).")
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT")
    optimizer.register(sub)
    train.register(sub)

    def show_help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 0

    parser.set_defaults(func=show_help)
