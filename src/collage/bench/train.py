"""``collage bench train``: tokens/s and peak memory of a GPT per strategy, beside
``torch.autocast(bfloat16)`` with float32 weights, in one run.

Memory: every mode in its own fresh process (peak memory is per process; on the CPU two of
them at a time, since each counts only its own allocator and resident set): it first
compiles the optimizer's kernels on a tiny model (so compilation is neither timed nor
counted), records its resident set, builds the model, trains ``warmup`` steps (at least
one) and then one more step under the allocator's count: peak memory is the most bytes held
by tensors during that step (:class:`collage.train.memory.TensorMemoryProbe`: weights,
gradients, states, activations, autocast's bf16 weight copies, temporaries);
``persistent`` counts the tensors that live across steps; the resident set's growth
(sampled every millisecond, minus the resident set before the model was built) is reported
beside it.

Speed: ``--rounds`` fresh processes (default 3), each holding every mode's model and
optimizer side by side and stepping them interleaved: ``warmup`` untimed steps each, then
``steps`` timed steps each (step k of every mode, the order rotated by k and by round), on
random tokens with a learning rate that changes every step (as a schedule does). Why
interleaved: a shared machine's speed drifts between processes by more than the
differences measured, so modes timed in separate processes compared the machine's
moods; steps of different modes taken moments apart share them. Tokens/s is the median
over every timed step (forward, backward, optimizer step, zero_grad); the ratio to
autocast the median over the steps of autocast's time at the same round and index over the
mode's.

Modes: ``fp32`` (float32 weights, torch.optim.AdamW fused), ``autocast`` (float32 weights,
bf16 autocast, torch.optim.AdamW fused) and every collage strategy (bf16 weights, fused
path; ``mixed`` keeps float32 masters). Every mode runs the same model and the same loss,
:func:`collage.train.losses.cross_entropy` (float32 loss of the bf16 logits without a
float32 copy of them, as ``collage train`` does); ``--checkpoint-activations`` makes every
mode recompute its blocks in backward; every mode keeps only the inputs of the MLP's
activation and computes it again in backward (the models' default, ``--no-recompute-mlp``
keeps it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import UsageError
from ..optim import AdamW, get_strategy
from ..optim.strategies import MAIN_STRATEGIES, NAMES
from ..optim.strategies.strategy import dtype_name
from ..train.presets import PRESETS, get_preset
from ..train.data import VOCAB_SIZE
from ..train.losses import cross_entropy
from ..train.memory import TensorMemoryProbe, persistent_bytes
from ..train.models import build_model
from . import common

__all__ = ["register", "run", "MODES"]

#: the collage modes: the main report's strategies of bf16 weights
STRATEGIES = tuple(name for name in MAIN_STRATEGIES
                   if torch.bfloat16 in get_strategy(name).weight_dtypes)
#: modes that train float32 weights with torch.optim.AdamW (fused), not a collage strategy:
#: ``fp32`` (named by its weights' dtype) and ``autocast``
TORCH_MODES = (dtype_name(torch.float32), "autocast")
MODES = TORCH_MODES + STRATEGIES
#: ``<strategy>+backward``: the strategy with ``step_in_backward=True`` (docs/memory.md);
#: asked for by name, not in the default set
IN_BACKWARD = "+backward"
VALID_MODES = MODES + tuple(s + IN_BACKWARD for s in STRATEGIES)


def _split_mode(mode: str) -> tuple[str, bool]:
    """(the strategy or torch mode, whether it steps in backward)."""
    base = mode.removesuffix(IN_BACKWARD)
    return base, base != mode
MODEL_FLAGS = ("d_model", "n_layers", "n_heads", "context", "checkpoint_activations",
               "recompute_mlp")


def _model_config(preset: str, overrides: dict):
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
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    if mode in TORCH_MODES:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    strategy, in_backward = _split_mode(mode)
    return AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, strategy=strategy,
                 fused=True, step_in_backward=in_backward)


class _Trainer:
    """One mode's model, optimizer and token stream on ``device``; :meth:`step` trains one
    step (a new learning rate each, as a schedule does) and returns its seconds (on CUDA
    synchronized around it)."""

    def __init__(self, mode: str, model_cfg, batch: int, seed: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.mode, self.batch, self.context = mode, batch, model_cfg.context
        self.vocab = VOCAB_SIZE
        self.device = device
        self.model = build_model(model_cfg, VOCAB_SIZE, seed=seed).to(device)
        if mode not in TORCH_MODES:  # the strategy's weight dtype (bf16; mixed: its copy)
            self.model = self.model.to(get_strategy(_split_mode(mode)[0]).weight_dtypes[0])
        self.lr = 1e-3
        self.optimizer = _optimizer(mode, self.model, self.lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.index = 0

    def step(self) -> float:
        tokens = torch.randint(0, self.vocab, (self.batch, self.context + 1),
                               generator=self.generator).to(self.device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        _synchronize(self.device)
        started = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.mode == "autocast"):
            logits = self.model(x)
        loss = cross_entropy(logits, y)
        del logits  # held by the loss for backward; nothing else needs it
        loss.backward()  # (``+backward`` modes step here, with the lr set last step)
        for group in self.optimizer.param_groups:  # a schedule: a new lr every step
            group["lr"] = self.lr * (0.5 + 0.5 * (self.index % 10) / 10)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.index += 1
        _synchronize(self.device)
        return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compile_kernels(mode: str, model_cfg, device: torch.device) -> None:
    """Two steps on a tiny model: the optimizer's kernels are compiled (dynamic shapes; on
    CUDA the Triton kernels) and the native library loaded before anything is timed or
    counted."""
    tiny = dataclasses.replace(model_cfg, d_model=32, n_layers=1, n_heads=2)
    trainer = _Trainer(mode, tiny, 2, seed=1, device=device)
    trainer.step()
    trainer.step()


def worker(spec: dict) -> dict:
    """Memory of one mode, in this process (a fresh interpreter, see :func:`run`): after
    ``warmup`` steps (at least one: the optimizer's states exist), one step under a
    :class:`TensorMemoryProbe` (the peak bytes held by tensors, by the allocator)."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    mode = spec["mode"]
    device = torch.device(spec.get("device", "cpu"))
    model_cfg, _ = _model_config(spec["preset"], spec["model"])
    _compile_kernels(mode, model_cfg, device)
    gc.collect()
    sampler = _PeakRSS()
    before = sampler.read()
    with sampler:
        trainer = _Trainer(mode, model_cfg, spec["batch"], seed=0, device=device)
        for _ in range(max(1, spec["warmup"])):
            trainer.step()
        probe = TensorMemoryProbe(device,
                                  persistent_bytes(trainer.model, trainer.optimizer)["total"])
        with probe:
            trainer.step()
    persistent = persistent_bytes(trainer.model, trainer.optimizer)
    return {
        "mode": mode,
        "n_params": persistent["n_params"],
        "tokens_per_step": spec["batch"] * model_cfg.context,
        "peak_bytes": probe.peak_bytes,
        "peak_rss_delta_bytes": sampler.peak - before,
        "persistent_bytes": persistent["model_total"],
    }


def speed_worker(spec: dict) -> dict:
    """Speed of every mode of ``spec["modes"]`` in this process (a fresh interpreter): each
    mode's model and optimizer side by side, ``warmup`` untimed steps each, then ``steps``
    timed steps each, interleaved (step k of every mode, the order rotated by k), so the
    modes share the machine's state of the moment. Returns each mode's step times."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    modes = spec["modes"]
    device = torch.device(spec.get("device", "cpu"))
    model_cfg, _ = _model_config(spec["preset"], spec["model"])
    for mode in modes:
        _compile_kernels(mode, model_cfg, device)
    trainers = {mode: _Trainer(mode, model_cfg, spec["batch"], seed=0, device=device)
                for mode in modes}
    for _ in range(spec["warmup"]):
        for trainer in trainers.values():
            trainer.step()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for k in range(spec["steps"]):
        shift = k % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            times[mode].append(trainers[mode].step())
    return {"times": times}


def _run_process(function: str, spec: dict) -> dict:
    """``function`` of this module on ``spec`` in a fresh interpreter."""
    code = (f"import json, sys; from collage.bench.train import {function}; "
            f"print(json.dumps({function}(json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        what = spec.get("mode") or ",".join(spec.get("modes", ()))
        raise RuntimeError(f"bench train: {what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#: Memory workers running at the same time on the CPU: each reads its own process's
#: allocator and resident set, which another process does not change. On a GPU one at a
#: time: they would share its memory.
CPU_MEMORY_JOBS = 2


def _timed_process(function: str, spec: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    return _run_process(function, spec), time.perf_counter() - started


def _memory_rows(modes, spec_base: dict, device, quiet: bool) -> list[dict]:
    """Every mode's :func:`worker` row, in the order of ``modes``."""
    jobs = CPU_MEMORY_JOBS if torch.device(device).type == "cpu" else 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running = [pool.submit(_timed_process, "worker", dict(spec_base, mode=mode))
                   for mode in modes]
        rows = []
        for mode, future in zip(modes, running):
            row, seconds = future.result()
            rows.append(row)
            _log(quiet, f"{mode:10s} peak {row['peak_bytes'] / 2**20:7.1f} MiB  persistent "
                        f"{row['persistent_bytes'] / 2**20:6.1f} MiB  ({seconds:.0f}s)")
    return rows


def _log(quiet: bool, text: str) -> None:
    if not quiet:
        print(f"[train] {text}", file=sys.stderr, flush=True)


def run(*, modes=MODES, preset="paper-small", model=None, batch=None, steps=20, warmup=3,
        threads=None, quiet=True, rounds=3, device="cpu") -> dict:
    """Memory: every mode once, in its own fresh process (peak memory is per process and
    the allocator's count does not vary; two at a time on the CPU). Speed: ``rounds`` fresh
    processes, each running every mode's steps interleaved (:func:`speed_worker`); a mode's
    tokens/s is the median over all its timed steps, its ratio to autocast the median over
    the steps of the ratio to autocast's step of the same round and index (timed moments
    apart)."""
    # before anything runs, so that the bench's own threads are not in it; the workers
    # run torch's default threads (every core) unless ``threads`` is given
    load = common.load_check(threads or torch.get_num_threads())
    common.warn_if_busy(load)
    environment = common.environment()
    model = model or {}
    model_cfg, preset_batch = _model_config(preset, model)
    batch = batch or preset_batch
    spec_base = {"preset": preset, "model": model, "batch": batch, "steps": steps,
                 "warmup": warmup, "threads": threads, "device": str(device)}
    rows = _memory_rows(modes, spec_base, device, quiet)
    times: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    speed_rounds = []
    for r in range(rounds):
        started = time.perf_counter()
        shift = r % len(modes)
        before = common.load_average()
        done = _run_process("speed_worker",
                            dict(spec_base, modes=list(modes[shift:] + modes[:shift])))
        for mode in modes:
            times[mode].append(done["times"][mode])
        # the 1, 5 and 15-minute load averages around the round: the bench's own threads
        # count in them (common.load_check)
        speed_rounds.append({"load_average": {"before": before,
                                              "after": common.load_average()},
                             "wall_s": time.perf_counter() - started})
        _log(quiet, f"speed round {r + 1}/{rounds} ({time.perf_counter() - started:.0f}s, "
                    f"load {common.load_1m(before)} -> "
                    f"{common.load_1m(speed_rounds[-1]['load_average']['after'])})")
    tokens = batch * model_cfg.context
    for row in rows:
        mine = times[row["mode"]]
        every = [t for round_times in mine for t in round_times]
        row["step_s"] = common.summary(every)
        row["tokens_per_s"] = tokens / statistics.median(every)
        row["tokens_per_s_rounds"] = [tokens / statistics.median(t) for t in mine]
    reference = next((r for r in rows if r["mode"] == "autocast"), None)
    if reference is not None:
        for row in rows:
            paired = [[ref / t for ref, t in zip(ref_round, my_round)]
                      for ref_round, my_round in zip(times["autocast"], times[row["mode"]])]
            row["tokens_per_s_vs_autocast_rounds"] = [statistics.median(p) for p in paired]
            row["tokens_per_s_vs_autocast"] = statistics.median(
                [x for p in paired for x in p])
            row["peak_vs_autocast"] = row["peak_bytes"] / max(reference["peak_bytes"], 1)
    checks = []
    plus = next((r for r in rows if r["mode"] == NAMES.plus), None)
    if plus and reference:
        checks.append({"check": f"{NAMES.plus} tokens/s >= autocast tokens/s",
                       "value": plus["tokens_per_s_vs_autocast"], "target": 1.0,
                       "holds": plus["tokens_per_s_vs_autocast"] >= 1.0})
        checks.append({"check": f"{NAMES.plus} peak memory <= 0.85 x autocast",
                       "value": plus["peak_vs_autocast"], "target": 0.85,
                       "holds": plus["peak_vs_autocast"] <= 0.85})
    return {
        "environment": environment,
        "load": load,
        "settings": {"preset": preset, "model": dataclasses.asdict(model_cfg),
                     "batch": batch, "steps": steps, "warmup": warmup, "threads": threads,
                     "rounds": rounds, "device": str(device)},
        "rows": rows,
        "speed_rounds": speed_rounds,
        "checks": checks,
    }


def _ratio(value: float | None) -> str:
    """A ratio to the autocast row, or "-" where no autocast row was run."""
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def table(result: dict) -> str:
    s = result["settings"]
    m = s["model"]
    n = result["rows"][0]["n_params"] if result["rows"] else 0
    lines = common.busy_lines(result)
    lines += [f"### GPT d_model={m['d_model']}, layers={m['n_layers']}, heads={m['n_heads']}, "
             f"context={m['context']}, batch={s['batch']} ({n / 1e6:.2f}M parameters"
             f"{', activation checkpointing' if m.get('checkpoint_activations') else ''}"
             f"{', MLP activation kept' if m.get('recompute_mlp') is False else ''}); "
             f"{s['steps']} timed steps after {s['warmup']}, {s.get('rounds', 1)} round(s) "
             "(medians)", "",
             "| mode | tokens/s | x autocast | step ms (median) | step ms (p90) | "
             "peak MiB | x autocast | persistent MiB | peak RSS growth MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | "
            f"{_ratio(r.get('tokens_per_s_vs_autocast'))} | "
            f"{1e3 * r['step_s']['median']:.0f} | {1e3 * r['step_s']['p90']:.0f} | "
            f"{r['peak_bytes'] / 2**20:.1f} | "
            f"{_ratio(r.get('peak_vs_autocast'))} | "
            f"{r['persistent_bytes'] / 2**20:.1f} | "
            f"{r['peak_rss_delta_bytes'] / 2**20:.1f} |")
    lines.append("")
    loads = [r["load_average"] for r in result.get("speed_rounds", [])]
    if loads:
        lines.append("Load average (1 minute) before -> after each speed round: "
                     + ", ".join(f"{common.load_1m(x['before'])} -> {common.load_1m(x['after'])}"
                                 for x in loads)
                     + " (the bench's own threads count in it as a round goes on).")
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
            Train a GPT-2-style model per mode: fp32 weights, torch.autocast(bfloat16)
            with fp32 weights, and every collage strategy on bf16 weights (fused path).
            Reports peak memory (the most bytes held by tensors during a step, measured by
            the allocator; each mode in a fresh process) and tokens/s (every mode's steps
            interleaved in one process, --rounds such processes)."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="paper-small",
                   help="model preset of `collage train` (default paper-small)")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--n-layers", type=int, help="override the preset's depth")
    p.add_argument("--n-heads", type=int, help="override the preset's heads")
    p.add_argument("--context", type=int, help="override the preset's sequence length")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--checkpoint-activations", action="store_true", default=None,
                   help="every mode recomputes each block's activations during backward "
                        "(the saved activations shrink to the blocks' inputs)")
    p.add_argument("--recompute-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="every mode keeps only the inputs of the MLP's activation and "
                        "computes it again in backward (default: the preset's, on)")
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps of every mode per speed round (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="speed rounds: fresh processes, each stepping every mode "
                        "interleaved (default 3)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated: {', '.join(MODES)} (default: all), or a "
                        f"strategy with {IN_BACKWARD}: it steps in backward (e.g. "
                        f"plus{IN_BACKWARD})")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda (default cpu); on CUDA peak memory is "
                        "torch.cuda.max_memory_allocated's")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write a markdown table there")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    modes = tuple(x.strip() for x in args.modes.split(",") if x.strip())
    for mode in modes:
        if mode not in VALID_MODES:
            raise UsageError(f"--modes: unknown mode {mode!r}; valid: {', '.join(MODES)}, "
                             f"and any strategy with {IN_BACKWARD} (step in backward)")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise UsageError("--steps and --rounds must be at least 1 and --warmup at least 0")
    if args.preset not in PRESETS:
        raise UsageError(f"--preset: unknown preset {args.preset!r}; valid: "
                         + ", ".join(PRESETS))
    common.device_argument(args.device)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    common.check_writable(args.markdown, "--markdown")
    model = {k: getattr(args, k) for k in MODEL_FLAGS}
    try:
        _model_config(args.preset, model)
    except TypeError as error:
        raise UsageError(str(error)) from None
    result = run(modes=modes, preset=args.preset, model=model, batch=args.batch_size,
                 steps=args.steps, warmup=args.warmup, threads=args.threads,
                 quiet=args.quiet or args.json, rounds=args.rounds, device=args.device)
    text = table(result)
    # printed first: the results survive a markdown file that cannot be written after all
    print(json.dumps(result, indent=1) if args.json else text)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    return 0
