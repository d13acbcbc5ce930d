"""How much of each intended second-moment EMA update lands, per strategy, in a real run.

Trains the ``paper-small`` model through the harness (``collage.train.runner.
train_strategy``, the function ``collage compare`` runs) and wraps the optimizer's ``step``:
every ``--every`` steps it reads Adam's second moment ``v`` before the step (decoded: hi +
lo for ``plus``, the 8-bit codes times their scales for ``plus8`` and torchao) and the
gradient the optimizer sees, and after the step the stored ``v`` again. Then

    intended  d = beta2 * v_before + (1 - beta2) * g**2 - v_before     (float64, exact)
    landed    e = v_after - v_before
    EDQ_v     = <e, d> / ||d||**2          (1: every intended increment landed)
    EDQ_v rel = the same with e and d divided by v_before elementwise (elements with
                v_before > 0): every element weighs the same, whatever its gradient scale
    stalled   = share of elements with d != 0 whose stored v did not change at all

summed over every parameter element of the model (the harness's EDQ of the weights, for
the EMA). Because the EMA feeds on its own stored value, each step is measured against
what the stored ``v`` intended at that step (a *per-step* landing ratio, not the
accumulated drift; the accumulated effect shows as the loss).

Usage: ``python benchmarks/studies/eight_bit_ema.py --steps 300 --out docs/reports/eight-bit-ema``
(writes ``ema_edq.json``, ``ema_edq.md`` and ``ema_edq.png`` there). One thread per run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import types

import torch

import collage

import collage.train.runner as runner
from collage.optim import get_strategy
from collage.optim.rules import ADAMW
from collage.train.presets import get_preset

STRATEGIES = ("plus8", "torchao-adamw8bit", "plus", "bf16", "mixed")


def second_moment(optimizer, param) -> torch.Tensor:
    """Adam's v of ``param`` as float64 (zeros before the first step)."""
    state = optimizer.state.get(param, {})
    if "exp_avg_sq" not in state:
        return torch.zeros(param.shape, dtype=torch.float64)
    if isinstance(optimizer, collage.AdamW):
        strategy = get_strategy(optimizer.param_groups[0]["strategy"])
        return strategy.moment_value(ADAMW, state, "exp_avg_sq")
    value = state["exp_avg_sq"]
    if hasattr(value, "dequantize"):  # torchao's OptimState8bit
        value = value.dequantize()
    return value.double()


class EmaMeter:
    """Wraps ``optimizer.step`` and accumulates the EMA landing sums every ``every`` steps."""

    def __init__(self, optimizer, every: int) -> None:
        self.optimizer, self.every, self.calls = optimizer, every, 0
        self.dot = self.dd = self.changed = self.wanted = self.rdot = self.rdd = 0.0
        self.per_step: list[tuple[int, float]] = []
        self._step = optimizer.step
        meter = self

        def step(_optimizer, closure=None):  # a method of the optimizer: LR schedulers
            return meter.step(closure)       # re-bind ``step.__func__`` to it

        optimizer.step = types.MethodType(step, optimizer)

    def step(self, closure=None):
        measure = self.calls % self.every == 0
        self.calls += 1
        if not measure:
            return self._step(closure)
        params = [p for g in self.optimizer.param_groups for p in g["params"]
                  if p.grad is not None]
        beta2 = self.optimizer.param_groups[0]["betas"][1]
        before = [second_moment(self.optimizer, p) for p in params]
        grads = [p.grad.double() for p in params]
        out = self._step(closure)
        dot = dd = 0.0
        for p, v0, g in zip(params, before, grads):
            d = beta2 * v0 + (1 - beta2) * g * g - v0
            e = second_moment(self.optimizer, p) - v0
            dot += float((e * d).sum())
            dd += float((d * d).sum())
            held = v0 > 0
            self.rdot += float((e[held] * d[held] / v0[held] ** 2).sum())
            self.rdd += float((d[held] ** 2 / v0[held] ** 2).sum())
            wanted = d != 0
            self.wanted += float(wanted.sum())
            self.changed += float((wanted & (e == 0)).sum())
        self.dot += dot
        self.dd += dd
        self.per_step.append((self.calls, dot / dd if dd else math.nan))
        return out

    def result(self) -> dict:
        return {"edq_v": self.dot / self.dd if self.dd else math.nan,
                "edq_v_relative": self.rdot / self.rdd if self.rdd else math.nan,
                "stalled_share": self.changed / self.wanted if self.wanted else math.nan,
                "per_step": self.per_step}


def run(strategy: str, beta2: float, steps: int, every: int) -> dict:
    config = get_preset("paper-small")
    config = config.replace(run={"steps": steps, "quiet": True, "track_every": 0,
                                 "eval_every": steps},
                            optim={"warmup_steps": min(config.optim.warmup_steps, steps // 4)})
    meters = []
    original = runner.make_optimizer

    def make(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        meters.append(EmaMeter(optimizer, every))
        return optimizer

    runner.make_optimizer = make
    try:
        summary = runner.train_strategy(config, strategy, beta2=beta2)["summary"]
    finally:
        runner.make_optimizer = original
    return {"strategy": strategy, "beta2": beta2, "steps": steps,
            "final_val_loss": summary["final_val_loss"], **meters[0].result()}


def plot(results: list[dict], path: str) -> None:
    """Per-step EMA EDQ of every strategy, one panel per beta2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beta2s = sorted({r["beta2"] for r in results})
    fig, axes = plt.subplots(1, len(beta2s), figsize=(5.5 * len(beta2s), 4), sharey=True,
                             squeeze=False)
    for ax, beta2 in zip(axes[0], beta2s):
        for r in results:
            if r["beta2"] == beta2:
                ax.plot([s for s, _ in r["per_step"]], [v for _, v in r["per_step"]],
                        marker=".", label=r["strategy"])
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"second-moment EMA EDQ per measured step, β2 = {beta2}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("<e, d> / ||d||²  (1: the intended EMA update landed)")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", default="docs/reports/eight-bit-ema")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for beta2 in (0.95, 0.999):
        for strategy in args.strategies.split(","):
            started = time.time()
            results.append(run(strategy, beta2, args.steps, args.every))
            r = results[-1]
            print(f"{strategy:<18} beta2 {beta2}: EMA EDQ {r['edq_v']:.4f} (relative "
                  f"{r['edq_v_relative']:.4f}), stalled "
                  f"{r['stalled_share']:.2%}, val loss {r['final_val_loss']:.4f} "
                  f"({time.time() - started:.0f} s)", flush=True)
    meta = {"preset": "paper-small", "steps": args.steps, "every": args.every,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                              time.gmtime())}
    with open(os.path.join(args.out, "ema_edq.json"), "w") as handle:
        json.dump({"meta": meta, "results": results}, handle, indent=1)
    lines = [f"Second-moment EMA landing, paper-small, first {args.steps} steps, measured "
             f"every {args.every} (benchmarks/studies/eight_bit_ema.py; {meta['date']}, torch "
             f"{meta['torch']})", "",
             "| strategy | β2 | EMA EDQ | EMA EDQ, relative | stalled elements | val loss "
             f"at step {args.steps} |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['strategy']} | {r['beta2']} | {r['edq_v']:.4f} | "
                     f"{r['edq_v_relative']:.4f} | "
                     f"{r['stalled_share']:.2%} | {r['final_val_loss']:.4f} |")
    with open(os.path.join(args.out, "ema_edq.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    plot(results, os.path.join(args.out, "ema_edq.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
