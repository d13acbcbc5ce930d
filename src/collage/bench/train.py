"""``collage bench train``: tokens/s and peak memory of a GPT per strategy, beside
``torch.autocast(bfloat16)`` with float32 weights, in one run.

Every mode runs in a fresh process (peak memory is per process), ``--rounds`` times (default
3) with the order of the modes rotated each round; tokens/s is the median over the rounds,
its ratio to autocast the median of the ratios within a round. A mode first compiles the
optimizer's kernels on a tiny model (so compilation is neither timed nor counted), records
its resident set, builds the model, and trains ``warmup + steps`` steps on random tokens
with a learning rate that changes every step (as a schedule does). Tokens/s covers the timed
steps (forward, backward, optimizer step, zero_grad); peak memory is the most bytes held
by tensors during one more (untimed) step, measured by the allocator
(:class:`collage.train.memory.TensorMemoryProbe`: weights, gradients, states, activations,
autocast's bf16 weight copies, temporaries); ``persistent`` counts the tensors that live
across steps; the resident set's growth (sampled every millisecond, minus the resident set
before the model was built) is reported beside it.

Modes: ``fp32`` (float32 weights, torch.optim.AdamW fused), ``autocast`` (float32 weights,
bf16 autocast, torch.optim.AdamW fused) and every collage strategy (bf16 weights, fused
path; ``mixed`` keeps float32 masters).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import torch

from ..cli import UsageError
from . import common

__all__ = ["register", "run", "MODES"]

STRATEGIES = ("mixed", "bf16", "kahan", "stochastic", "light", "plus", "split")
MODES = ("fp32", "autocast") + STRATEGIES
MODEL_FLAGS = ("d_model", "n_layers", "n_heads", "context")


def _model_config(preset: str, overrides: dict):
    from ..train.config import get_preset

    config = get_preset(preset)
    model = dataclasses.replace(config.model, family="gpt", dropout=0.0,
                                **{k: v for k, v in overrides.items() if v is not None})
    return model, config.data.batch_size


class _PeakRSS:
    """Samples this process's resident set every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> int:
        try:
            with open("/proc/self/statm") as handle:
                return int(handle.read().split()[1]) * self._page
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def _optimizer(mode: str, model: torch.nn.Module, lr: float):
    import collage

    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    if mode in ("fp32", "autocast"):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return collage.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, strategy=mode,
                         fused=True)


def _train(mode: str, model_cfg, batch: int, steps: int, seed: int, probe: bool = False):
    """Train ``steps`` steps; returns (model, optimizer, per-step times, probe). With
    ``probe`` one more step runs, untimed, under a :class:`TensorMemoryProbe` (the peak bytes
    held by tensors during a step, measured by the allocator)."""
    import torch.nn.functional as F

    from ..train.data import VOCAB_SIZE
    from ..train.memory import TensorMemoryProbe, persistent_bytes
    from ..train.models import build_model

    model = build_model(model_cfg, VOCAB_SIZE, seed=seed)
    if mode not in ("fp32", "autocast"):
        model = model.to(torch.bfloat16)
    lr = 1e-3
    optimizer = _optimizer(mode, model, lr)
    generator = torch.Generator().manual_seed(seed)
    context = model_cfg.context
    times, probed = [], None
    for step in range(steps + int(probe)):
        if step == steps:  # the extra, measured step
            probed = TensorMemoryProbe(torch.device("cpu"),
                                       persistent_bytes(model, optimizer)["total"])
            probed.__enter__()
        tokens = torch.randint(0, VOCAB_SIZE, (batch, context + 1), generator=generator)
        x, y = tokens[:, :-1], tokens[:, 1:]
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        for group in optimizer.param_groups:  # a schedule: a new lr every step
            group["lr"] = lr * (0.5 + 0.5 * (step % 10) / 10)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == steps:
            probed.__exit__(None, None, None)
        else:
            times.append(time.perf_counter() - started)
    return model, optimizer, times, probed


def worker(spec: dict) -> dict:
    """One mode in this process (called in a fresh interpreter by :func:`run`)."""
    from ..train.memory import persistent_bytes
    from ..train.models import build_model  # noqa: F401 (import cost outside the timing)

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    mode = spec["mode"]
    model_cfg, _ = _model_config(spec["preset"], spec["model"])
    tiny = dataclasses.replace(model_cfg, d_model=32, n_layers=1, n_heads=2)
    _train(mode, tiny, 2, 2, seed=1)  # compiles the optimizer kernels (dynamic shapes)
    gc.collect()
    sampler = _PeakRSS()
    before = sampler.read()
    with sampler:
        model, optimizer, times, probed = _train(mode, model_cfg, spec["batch"],
                                                 spec["warmup"] + spec["steps"], seed=0,
                                                 probe=True)
    persistent = persistent_bytes(model, optimizer)
    timed = times[spec["warmup"]:]
    tokens = spec["batch"] * model_cfg.context
    return {
        "mode": mode,
        "n_params": persistent["n_params"],
        "tokens_per_step": tokens,
        "step_s": common.summary(timed),
        "tokens_per_s": tokens / statistics.median(timed),
        "peak_bytes": probed.peak_bytes,
        "peak_rss_delta_bytes": sampler.peak - before,
        "persistent_bytes": persistent["model_total"],
    }


def _run_mode(spec: dict, quiet: bool) -> dict:
    """One mode in a fresh interpreter."""
    code = ("import json, sys; from collage.bench.train import worker; "
            "print(json.dumps(worker(json.loads(sys.argv[1]))))")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench train: mode {spec['mode']} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if not quiet:
        print(f"[train] {spec['mode']:10s} {row['tokens_per_s']:9.0f} tokens/s  peak "
              f"{row['peak_bytes'] / 2**20:7.1f} MiB  persistent "
              f"{row['persistent_bytes'] / 2**20:6.1f} MiB  "
              f"({time.perf_counter() - started:.0f}s)", file=sys.stderr, flush=True)
    return row


def run(*, modes=MODES, preset="paper-small", model=None, batch=None, steps=10, warmup=3,
        threads=None, quiet=True, rounds=1) -> dict:
    """Every mode once per round, the order rotated each round (a machine whose speed
    drifts affects all modes alike); a mode's tokens/s is its median over the rounds and its
    ratio to autocast the median of the ratios within a round. Peak memory is the
    allocator's count, the same every round: the first round's."""
    model = model or {}
    model_cfg, preset_batch = _model_config(preset, model)
    batch = batch or preset_batch
    spec_base = {"preset": preset, "model": model, "batch": batch, "steps": steps,
                 "warmup": warmup, "threads": threads}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(rounds):
        shift = r % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            runs[mode].append(_run_mode(dict(spec_base, mode=mode), quiet))
    rows = []
    for mode in modes:
        row = dict(runs[mode][0])
        row["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in runs[mode]]
        row["tokens_per_s"] = statistics.median(row["tokens_per_s_rounds"])
        rows.append(row)
    reference = runs.get("autocast")
    for row in rows:
        if reference:
            ratios = [x["tokens_per_s"] / ref["tokens_per_s"]
                      for x, ref in zip(runs[row["mode"]], reference)]
            row["tokens_per_s_vs_autocast_rounds"] = ratios
            row["tokens_per_s_vs_autocast"] = statistics.median(ratios)
            row["peak_vs_autocast"] = row["peak_bytes"] / max(reference[0]["peak_bytes"], 1)
    checks = []
    plus = next((r for r in rows if r["mode"] == "plus"), None)
    if plus and reference:
        checks.append({"check": "plus tokens/s >= autocast tokens/s",
                       "value": plus["tokens_per_s_vs_autocast"], "target": 1.0,
                       "holds": plus["tokens_per_s_vs_autocast"] >= 1.0})
        checks.append({"check": "plus peak memory <= 0.85 x autocast",
                       "value": plus["peak_vs_autocast"], "target": 0.85,
                       "holds": plus["peak_vs_autocast"] <= 0.85})
    return {
        "environment": common.environment(),
        "settings": {"preset": preset, "model": dataclasses.asdict(model_cfg),
                     "batch": batch, "steps": steps, "warmup": warmup, "threads": threads,
                     "rounds": rounds},
        "rows": rows,
        "checks": checks,
    }


def table(result: dict) -> str:
    s = result["settings"]
    m = s["model"]
    n = result["rows"][0]["n_params"] if result["rows"] else 0
    lines = [f"### GPT d_model={m['d_model']}, layers={m['n_layers']}, heads={m['n_heads']}, "
             f"context={m['context']}, batch={s['batch']} ({n / 1e6:.2f}M parameters); "
             f"{s['steps']} timed steps after {s['warmup']}, {s.get('rounds', 1)} round(s) "
             "(medians)", "",
             "| mode | tokens/s | x autocast | step ms (median) | step ms (p90) | "
             "peak MiB | x autocast | persistent MiB | peak RSS growth MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | "
            f"{r.get('tokens_per_s_vs_autocast', float('nan')):.2f} | "
            f"{1e3 * r['step_s']['median']:.0f} | {1e3 * r['step_s']['p90']:.0f} | "
            f"{r['peak_bytes'] / 2**20:.1f} | "
            f"{r.get('peak_vs_autocast', float('nan')):.2f} | "
            f"{r['persistent_bytes'] / 2**20:.1f} | "
            f"{r['peak_rss_delta_bytes'] / 2**20:.1f} |")
    lines.append("")
    for c in result["checks"]:
        lines.append(f"* {c['check']}: {c['value']:.2f} (target {c['target']:g}): "
                     f"{'holds' if c['holds'] else 'does not hold'}")
    lines.append("")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="tokens/s and peak memory of a GPT per strategy vs autocast",
        description=textwrap.dedent("""\
            Train a GPT-2-style model for a few steps per mode, each in a fresh process:
            fp32 weights, torch.autocast(bfloat16) with fp32 weights, and every collage
            strategy on bf16 weights (fused path). Reports tokens/s and peak memory (the most
            bytes held by tensors during a step, measured by the allocator)."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="paper-small",
                   help="model preset of `collage train` (default paper-small)")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--n-layers", type=int, help="override the preset's depth")
    p.add_argument("--n-heads", type=int, help="override the preset's heads")
    p.add_argument("--context", type=int, help="override the preset's sequence length")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="run every mode this many times, the order rotated (default 3)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated: {', '.join(MODES)} (default: all)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write a markdown table there")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    modes = tuple(x.strip() for x in args.modes.split(",") if x.strip())
    for mode in modes:
        if mode not in MODES:
            raise UsageError(f"--modes: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise UsageError("--steps and --rounds must be at least 1 and --warmup at least 0")
    from ..train.config import PRESETS

    if args.preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {args.preset!r}; valid: "
                         + ", ".join(PRESETS))
    model = {k: getattr(args, k) for k in MODEL_FLAGS}
    try:
        _model_config(args.preset, model)
    except TypeError as error:
        raise UsageError(str(error)) from None
    result = run(modes=modes, preset=args.preset, model=model, batch=args.batch_size,
                 steps=args.steps, warmup=args.warmup, threads=args.threads,
                 quiet=args.quiet or args.json, rounds=args.rounds)
    text = table(result)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    print(json.dumps(result, indent=1) if args.json else text)
    return 0
