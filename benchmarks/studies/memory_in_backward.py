"""Peak memory of the step in backward (issue #32's goals), measured as the harness measures
it: the allocator's count over one training step (``summary["peak_memory_bytes"]``,
``cpu_allocator_events`` on CPU, ``max_memory_allocated`` on CUDA).

A model whose weights dominate (a wide GPT on a batch of one short sequence: activations
are a small fraction), three runs from the same weights, none clipping (the step in
backward cannot clip; the others do not either, so that only the step differs):

* ``mixed``: bf16 model + fp32 master, normal step (the memory model: 16 B/param);
* ``plus``: normal step (12 B/param);
* ``plus`` with ``--step-in-backward`` (10 B/param: no gradient outlives backward).

Goals: in-backward peak <= 0.65x mixed's and <= 0.87x plus's; each peak within 3 % of its
memory model (``collage memory``: bytes per parameter x parameters).

Usage: python benchmarks/studies/memory_in_backward.py --out docs/benchmarks/NAME
"""

from __future__ import annotations

import torch

from collage.train.presets import get_preset
from collage.train.memory import bytes_per_param
from collage.train.runner import train_strategy

import record  # benchmarks/studies/record.py: this script's folder is on the path

RUNS = (("mixed", "mixed", False, "bf16"), ("plus", "plus", False, "bf16"),
        ("plus_in_backward", "plus", True, "none"))


def config(d_model: int, n_layers: int, step_in_backward: bool):
    base = get_preset("micro")
    return base.replace(
        model={"d_model": d_model, "n_layers": n_layers, "n_heads": 4, "context": 8},
        data={"batch_size": 1},
        optim={"grad_clip": 0.0, "step_in_backward": step_in_backward, "warmup_steps": 1},
        run={"steps": 3, "eval_every": 3, "eval_batches": 1, "track_every": 0,
             "quiet": True})


def measure(d_model: int, n_layers: int) -> dict:
    rows = {}
    for label, strategy, in_backward, grad in RUNS:
        summary = train_strategy(config(d_model, n_layers, in_backward), strategy)["summary"]
        n = summary["n_params"]
        model = bytes_per_param(strategy, grad).total * n
        rows[label] = {"peak_bytes": summary["peak_memory_bytes"],
                       "measured": summary["peak_memory_measured"], "n_params": n,
                       "model_bytes": model,
                       "peak_over_model": summary["peak_memory_bytes"] / model}
    peak = rows["plus_in_backward"]["peak_bytes"]
    ratios = {"in_backward_over_mixed": peak / rows["mixed"]["peak_bytes"],
              "in_backward_over_plus": peak / rows["plus"]["peak_bytes"]}
    return {"rows": rows, "ratios": ratios}


def markdown(meta: dict, result: dict) -> str:
    lines = [f"# Peak memory of the step in backward ({meta['date']})", "",
             f"Hardware: {meta['hardware']}; torch {meta['torch']}; model: GPT d_model "
             f"{meta['d_model']}, {meta['n_layers']} layers, context 8, batch 1.", "",
             f"Command: `{meta['command']}`", "",
             "| run | parameters | measured peak (MB) | memory model (MB) | peak / model |",
             "|---|---|---|---|---|"]
    for label, r in result["rows"].items():
        lines.append(f"| {label} | {r['n_params']:,} | {r['peak_bytes'] / 1e6:.2f} | "
                     f"{r['model_bytes'] / 1e6:.2f} | {r['peak_over_model']:.3f} |")
    ratios = result["ratios"]
    lines += ["", f"In backward / mixed: {ratios['in_backward_over_mixed']:.3f} (goal <= 0.65); "
              f"in backward / plus: {ratios['in_backward_over_plus']:.3f} (goal <= 0.87)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = record.parser(__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.d_model, args.n_layers)
    meta = record.metadata(
        args.hardware, d_model=args.d_model, n_layers=args.n_layers,
        command=f"python benchmarks/studies/memory_in_backward.py --out {args.out} "
                f"--d-model {args.d_model} --n-layers {args.n_layers}")
    record.write(args.out, meta, result, markdown)


if __name__ == "__main__":
    main()
