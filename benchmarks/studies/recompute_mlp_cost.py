"""Cost of recomputing the MLP's activation in backward (``ModelConfig.recompute_mlp``).

One process holds, for each mode, two copies of the same model (the same weights and
tokens), one that keeps the activation for backward and one that recomputes it, and steps
all of them interleaved (the order rotated every step), so both sides of a ratio share the
machine's state of the moment. Prints each mode's median step time with the activation kept
and recomputed, and the median over steps of the paired time ratio recomputed / kept.

    python benchmarks/studies/recompute_mlp_cost.py                      # paper-small, 40 steps
    python benchmarks/studies/recompute_mlp_cost.py --steps 20 --modes autocast,plus,bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from collage.bench.train import MODES, _compile_kernels, _model_config, _Trainer

#: the device of the trainers (``_Trainer``'s default): the kernels are compiled for it
CPU = torch.device("cpu")


def measure(preset: str, modes: list[str], steps: int, warmup: int) -> dict[str, dict]:
    config, batch = _model_config(preset, {})
    trainers = {}
    for mode in modes:
        _compile_kernels(mode, config, CPU)
        for recompute in (False, True):
            trainers[(mode, recompute)] = _Trainer(
                mode, dataclasses.replace(config, recompute_mlp=recompute), batch, seed=0)
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step()
    keys = list(trainers)
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in keys}
    for k in range(steps):
        shift = k % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(trainers[key].step())
    return {
        mode: {
            "kept_ms": 1e3 * statistics.median(times[(mode, False)]),
            "recomputed_ms": 1e3 * statistics.median(times[(mode, True)]),
            "ratio": statistics.median(
                a / b for a, b in zip(times[(mode, True)], times[(mode, False)])),
        }
        for mode in modes
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-small")
    parser.add_argument("--modes", default="autocast,plus",
                        help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; valid: {', '.join(MODES)}")
    print("| mode | step ms, kept | step ms, recomputed | recomputed / kept (median of "
          "paired steps) |")
    print("|---|---:|---:|---:|")
    for mode, row in measure(args.preset, modes, args.steps, args.warmup).items():
        print(f"| {mode} | {row['kept_ms']:.1f} | {row['recomputed_ms']:.1f} | "
              f"{row['ratio']:.3f} |")


if __name__ == "__main__":
    main()
