"""Gradient clipping then a fused step, with and without the proof of finiteness that
``optimizer.clip_grad_norm_`` hands to the step.

Three copies of the same GPT-shaped parameters and gradients (``collage.bench`` sizes), one
collage AdamW each (fused path), stepped interleaved (the order rotated every repeat) after
warm-up:

* ``torch clip``: ``torch.nn.utils.clip_grad_norm_`` then ``step()`` with the default
  ``nonfinite='skip'``, which reads every gradient once more to check it;
* ``opt.clip_grad_norm_``: the same clipping by the optimizer, whose finite norm spares the
  step that read;
* ``no check``: torch's clipping then a step with ``nonfinite='ignore'`` (the floor).

Prints the median time of clip + step per parameter and the median over repeats of the
paired ratio to ``torch clip``.

    python benchmarks/clip_then_step.py                       # plus, 16m
    python benchmarks/clip_then_step.py --size 100m --strategy light --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import collage
from collage.bench.common import SIZES, gpt_shapes
from collage.bench.measure import make_params  # what `collage bench optimizer` steps


def _variants(size: str, strategy: str):
    def torch_clip(params, opt):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def our_clip(params, opt):
        opt.clip_grad_norm_(1.0)
        opt.step()

    out = {}
    for name, fn, nonfinite in (("torch clip", torch_clip, "skip"),
                                ("opt.clip_grad_norm_", our_clip, "skip"),
                                ("no check", torch_clip, "ignore")):
        params = make_params(gpt_shapes(size), torch.bfloat16, torch.device("cpu"), seed=0)
        opt = collage.AdamW(params, lr=1e-3, strategy=strategy, fused=True,
                            nonfinite=nonfinite)
        out[name] = (fn, params, opt)
    return out


def measure(size: str, strategy: str, repeats: int, warmup: int) -> dict[str, dict]:
    variants = _variants(size, strategy)
    for fn, params, opt in variants.values():
        for _ in range(warmup):
            fn(params, opt)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for k in range(repeats):
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            fn, params, opt = variants[name]
            started = time.perf_counter()
            fn(params, opt)
            times[name].append(time.perf_counter() - started)
    n = sum(p.numel() for p in variants[names[0]][1])
    base = times["torch clip"]
    return {name: {"ns_per_param": 1e9 * statistics.median(t) / n,
                   "vs_torch_clip": statistics.median(a / b for a, b in zip(t, base))}
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16m", choices=list(SIZES))
    parser.add_argument("--strategy", default="plus")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    result = measure(args.size, args.strategy, args.repeats, args.warmup)
    print(f"{args.strategy}, {args.size}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print("| clip + step | ns/param | time / torch clip's (median of paired repeats) |")
    print("|---|---:|---:|")
    for name, row in result.items():
        print(f"| {name} | {row['ns_per_param']:.3f} | {row['vs_torch_clip']:.3f} |")


if __name__ == "__main__":
    main()
