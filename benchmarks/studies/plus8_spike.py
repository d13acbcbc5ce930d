"""How one gradient spike moves the other elements of its block of 128, under plus8.

One block of 128 weights (zeros) is stepped by AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
no weight decay) on a constant gradient of 1e-4, except that element 0's first gradient is
``spike`` times larger. Float64 AdamW moves every small element by exactly one learning rate
per step. The record gives, for the 127 small elements, in learning rates: the largest single
step, and the mean and the largest total movement after ``--steps`` steps, for float64 AdamW
(torch.optim), ``plus`` and ``plus8`` (default path, seed 0).

Why it matters (docs/eight_bit.md, limitations): after the spike, v's block maximum decays
about 100 times more slowly than m's; where v's format rounded the small elements' v to zero
while their m was resolved again, each step was ``m / eps``.

Usage::

    python benchmarks/studies/plus8_spike.py --out docs/benchmarks/NAME
"""

from __future__ import annotations

import torch

import collage
import record  # benchmarks/studies/record.py: this script's folder is on the path
from collage.optim import get_strategy, kernels

BLOCK, SMALL, LR = 128, 1e-4, 1e-3
SPIKES = (1e5, 1e6, 1e7, 1e9)
STRATEGIES = ("fp64", "plus", "plus8")


def optimizer(strategy: str) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    adam = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if strategy == "fp64":
        w = torch.nn.Parameter(torch.zeros(BLOCK, dtype=torch.float64))
        return w, torch.optim.AdamW([w], **adam)
    w = torch.nn.Parameter(torch.zeros(BLOCK, dtype=torch.bfloat16))
    return w, collage.AdamW([w], strategy=strategy, seed=0, **adam)


def value(strategy: str, w: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    """The weights the optimizer represents, exactly, in float64."""
    if strategy == "fp64":
        return w.detach().clone()
    return kernels.represented_value(get_strategy(strategy), w.detach(), opt.state[w])


def measure_one(strategy: str, spike: float, steps: int) -> dict:
    w, opt = optimizer(strategy)
    start = value(strategy, w, opt)
    before, largest = start, 0.0
    for t in range(steps):
        g = torch.full((BLOCK,), SMALL, dtype=torch.float64)
        if t == 0:
            g[0] = spike * SMALL
        w.grad = g.to(w.dtype)
        opt.step()
        now = value(strategy, w, opt)
        largest = max(largest, (now - before)[1:].abs().max().item() / LR)
        before = now
    total = (before - start)[1:].abs() / LR
    return {"largest_step": largest, "mean_movement": total.mean().item(),
            "largest_movement": total.max().item()}


def measure(steps: int) -> dict:
    return {"steps": steps,
            "rows": [{"spike": spike, "strategy": strategy, **measure_one(strategy, spike, steps)}
                     for spike in SPIKES for strategy in STRATEGIES]}


def markdown(meta: dict, result: dict) -> str:
    lines = [f"# plus8: one gradient spike in a block of 128 ({meta['date']}, {meta['hardware']})",
             "", f"torch {meta['torch']}, collage at `{meta['revision']}`. Command: "
             f"`{meta['command']}`", "",
             f"In learning rates, over the 127 small elements, after {result['steps']} steps "
             f"(float64 AdamW moves each exactly {result['steps']}):", "",
             "| spike | strategy | largest step | mean movement | largest movement |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['spike']:.0e} | `{row['strategy']}` | {row['largest_step']:.2f} "
                     f"| {row['mean_movement']:.1f} | {row['largest_movement']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = record.parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--revision", default="working tree",
                        help="the collage revision measured, for the record")
    args = parser.parse_args()
    torch.set_num_threads(1)
    meta = record.metadata(
        args.hardware, revision=args.revision,
        command=f"python benchmarks/studies/plus8_spike.py --out {args.out} --steps {args.steps}")
    record.write(args.out, meta, measure(args.steps), markdown)


if __name__ == "__main__":
    main()
