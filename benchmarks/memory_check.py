"""Measured peak memory of harness runs against ``collage memory``'s model.

For each strategy: train a few steps with the harness (``train_strategy``, what ``collage
train`` and ``collage compare`` run), take the peak bytes held by tensors during one step as
the allocator measures it (``TensorMemoryProbe``), and set it beside the persistent bytes
``collage memory`` predicts for the same model. Prints a markdown table.

    python benchmarks/memory_check.py                       # d 512, 4 layers, 16 tokens
    python benchmarks/memory_check.py --preset paper-small  # activations dominate there
"""

from __future__ import annotations

import argparse

import torch

from collage.train.presets import get_preset
from collage.train.data import VOCAB_SIZE
from collage.train.memory import bytes_per_param
from collage.train.models import build_model
from collage.train.runner import train_strategy

WIDE = {"model": {"d_model": 512, "n_layers": 4, "n_heads": 4, "context": 16},
        "data": {"batch_size": 1}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None,
                        help="a harness preset (default: micro widened to d 512, 4 layers, "
                        "one sequence of 16 tokens, so that persistent tensors dominate)")
    parser.add_argument("--strategies", default="fp32,mixed,bf16,kahan,light,plus,plus8,"
                        "torchao-adamw8bit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = {} if args.preset else WIDE
    config = get_preset(args.preset or "micro").replace(
        **sections, run={"steps": 3, "eval_every": 3, "eval_batches": 1, "track_every": 2,
                         "quiet": True},
        optim={"warmup_steps": 1})
    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(config.model, VOCAB_SIZE).parameters())
    print(f"{config.preset} model, {n:,} parameters, batch {config.data.batch_size} x "
          f"{config.model.context} tokens; torch {torch.__version__}\n")
    print("| strategy | collage memory MiB | persistent MiB | optimizer step peak MiB "
          "| step peak MiB | peak / collage memory |")
    print("|---|---:|---:|---:|---:|---:|")
    for strategy in args.strategies.split(","):
        try:
            s = train_strategy(config, strategy)["summary"]
        except ImportError as error:  # torchao not installed
            print(f"| {strategy} | skipped: {error} |")
            continue
        predicted = bytes_per_param(strategy).total * n
        mib = 2**20
        print(f"| {strategy} | {predicted / mib:.2f} | {s['persistent_bytes'] / mib:.2f} "
              f"| {s['optimizer_step_peak_bytes'] / mib:.2f} "
              f"| {s['peak_memory_bytes'] / mib:.2f} "
              f"| {s['peak_memory_bytes'] / predicted:.3f} |")


if __name__ == "__main__":
    main()
