"""What does ``strategy="auto"`` cost a step, against the strategy mix it holds (#43's goal:
within 5 %)?

The same tensors (a GPT-like set: matrices, embeddings, norm gains; bf16 weights, AdamW) in
two optimizers, both left with the same mix of rungs: ``auto`` (its norm gains at 1.0 lose
every update and are promoted to ``light`` at its first measured step, as is every other
tensor named by ``--promote``), and a ``mixed`` optimizer of two fixed param groups (``bf16``
and ``light``) holding the same tensors. Then rounds of ``--steps`` steps on each, interleaved
(A B A B ...: the machine's load drifts), on fresh gradients drawn once. Reported: the
median and p90 of a step's time per side and their ratio; ``auto``'s rounds include its
measured steps (every ``--every``-th: the autopilot's whole cost), and the same figure
without them.

    python benchmarks/studies/autopilot_overhead.py --width 512 --layers 4 --rounds 21
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import collage
from collage.optim.strategies import NAMES


def _tensors(width: int, layers: int, vocab: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = [("wte.weight", (vocab, width))]
    for i in range(layers):
        shapes += [(f"h.{i}.ln_1.weight", (width,)), (f"h.{i}.attn.c_attn.weight", (3 * width, width)),
                   (f"h.{i}.attn.c_proj.weight", (width, width)), (f"h.{i}.ln_2.weight", (width,)),
                   (f"h.{i}.mlp.c_fc.weight", (4 * width, width)),
                   (f"h.{i}.mlp.c_proj.weight", (width, 4 * width))]
    shapes += [("ln_f.weight", (width,)), ("lm_head.weight", (vocab, width))]
    out = []
    for name, shape in shapes:
        value = torch.ones(shape) if "ln" in name else torch.randn(shape, generator=g) * 0.02
        out.append((name, torch.nn.Parameter(value.to(torch.bfloat16))))
    return out


def _grads(params, count: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(p.shape, generator=g) * 1e-3).to(torch.bfloat16) for _, p in params]
            for _ in range(count)]


def _timed(opt, params, grads, steps: int, measured: list[bool], first: int) -> list[float]:
    times = []
    for i in range(steps):
        for (_, p), grad in zip(params, grads[(first + i) % len(grads)]):
            p.grad = grad
        measured.append(opt._pilot.due(opt._steps_taken))
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--promote", default="mlp", help="name part of the tensors also "
                        "promoted to light (with the norm gains)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    auto_params = _tensors(args.width, args.layers, args.vocab)
    mix_params = _tensors(args.width, args.layers, args.vocab)
    # threshold 0.99: the mix stays as set while timing (a tensor losing all its updates
    # would still move; the result counts the decisions made while timing)
    auto = collage.AdamW(auto_params, lr=1e-4, weight_decay=0.0, strategy="auto",
                         autopilot=collage.Autopilot(every=args.every, threshold=0.99))
    grads = _grads(auto_params, 4)
    _timed(auto, auto_params, grads, 1, [], 0)  # step 0: measured, the norms promoted
    for name, p in auto_params:  # the rest of the mix, promoted as the pilot would
        if args.promote in name and auto.strategy_of(p) == NAMES.bf16:
            auto._pilot.rungs[auto._positions[id(p)]] = NAMES.light
            auto.state[p] = collage.optim.convert.convert(
                auto.rule, collage.optim.get_strategy(NAMES.bf16),
                collage.optim.get_strategy(NAMES.light), p, auto.state[p], 0,
                auto._positions[id(p)])
            auto._books[id(auto.param_groups[0])].cache = {}
    rungs = [auto.strategy_of(p) for _, p in auto_params]
    groups = [{"params": [p for (_, p), r in zip(mix_params, rungs) if r == rung],
               "strategy": rung} for rung in (NAMES.bf16, NAMES.light)]
    mix = collage.AdamW([g for g in groups if g["params"]], lr=1e-4, weight_decay=0.0)
    _timed(mix, mix_params, grads, 1, [], 0)

    decided = len(auto.autopilot_decisions)
    t_auto, t_mix, flags = [], [], []
    for r in range(args.rounds):
        a = _timed(auto, auto_params, grads, args.steps, flags, r)
        b = _timed(mix, mix_params, grads, args.steps, [], r)
        if r:  # the first round warms up
            t_auto += a
            t_mix += b
    flags = flags[args.steps:]
    plain = [t for t, m in zip(t_auto, flags) if not m]
    total_auto, total_mix = sum(t_auto), sum(t_mix)

    def p90(xs):
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    n = sum(p.numel() for _, p in auto_params)
    result = {
        "params": n, "tensors": len(auto_params),
        "light_fraction": sum(p.numel() for (_, p), r in zip(auto_params, rungs)
                              if r == NAMES.light) / n,
        "auto_bytes_per_param": auto._pilot.bytes_per_param(auto),
        "median_ms": {"auto": 1e3 * statistics.median(t_auto),
                      "auto_unmeasured": 1e3 * statistics.median(plain),
                      "mix": 1e3 * statistics.median(t_mix)},
        "p90_ms": {"auto": 1e3 * p90(t_auto), "mix": 1e3 * p90(t_mix)},
        "ratio_of_totals": total_auto / total_mix,
        "ratio_of_medians_unmeasured": statistics.median(plain) / statistics.median(t_mix),
        "measured_steps": sum(flags), "steps_per_side": len(t_auto),
        "decisions_while_timing": len(auto.autopilot_decisions) - decided,
        "same_mix_at_the_end": rungs == [auto.strategy_of(p) for _, p in auto_params],
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
    main()
