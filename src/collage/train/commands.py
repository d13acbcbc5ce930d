"""The ``compare``, ``train`` and ``memory`` subcommands of ``collage``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from typing import Any

import torch

from ..errors import UsageError
from ..optim import AUTO, Autopilot, CollageOptimizer, consolidate
from ..optim.export import full_precision_copy
from ..optim.rules import ADAMW
from .build import resolve_device
from .checkpoint import save_atomic
from .compare import compare
from .config import Config, strategies
from .data import load_corpus, make_batches, vocab_size
from .distributed import launch, teardown, under_launcher
from .flags import add_config_flags, config_from_args
from .memory import (COMPARED_WITH, DEFAULT_GRAD_DTYPE, GRAD_DTYPES, bytes_per_param,
                     memory_table)
from .models import build_model, is_causal
from .outputs import write_json
from .runner import train_strategy
from .runs import plan_runs
from .sizing import format_plan, plan_of

__all__ = ["register", "parse_count"]

_FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="train one model under several precision strategies and report",
        description=textwrap.dedent("""\
            Train the same model from the same float32 initial weights on the same batches
            under several precision strategies (default: all), then write results.json,
            results.csv, history.json, config.json, report.md and PNG plots to --out.
            A preset (default quick) sets every value; explicit flags override it."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, "compare")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (runs, parameters, tokens per run; for a preset with "
                   "a time budget, such as gpu-study, the estimated seconds per run and in "
                   "all) and train nothing: no corpus is read, no GPU is needed")
    p.set_defaults(func=cmd_compare)

    p = subparsers.add_parser(
        "train",
        help="train one strategy, with atomic checkpoints and --resume",
        description=textwrap.dedent("""\
            Train one strategy (--strategy). With --out DIR a checkpoint (model, optimizer,
            scheduler, data position, RNG states, history) is written atomically to
            DIR/checkpoint.pt every --checkpoint-every steps and at the end; --resume
            continues an interrupted run exactly. The final full-precision weights
            (collage.consolidate) go to DIR/model_fp32.pt."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, "train")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser(
        "memory",
        help="bytes per parameter of each strategy and totals for a model size",
        description="The persistent memory (weights, gradients, optimizer states, "
        "compensation) of each strategy per parameter, and in total for --params "
        "parameters, or for the model of a harness preset (--preset and the model flags: "
        "its parameters are counted); activations are not included.",
        formatter_class=_FORMATTER,
    )
    p.add_argument("--params", default=None, metavar="N",
                   help="number of parameters: 6.7e9, 7B, 125M, 350k (default: 6.7e9, or "
                   "the model of --preset / the model flags when given)")
    p.add_argument("--strategy", nargs="+", default=None, metavar="NAME",
                   help="strategies to show, space or comma separated (default: all)")
    p.add_argument("--grad-dtype", default=DEFAULT_GRAD_DTYPE, metavar="{bf16,fp32,none}",
                   help="gradient bytes: bf16 (the low-precision strategies' own), fp32 "
                   "(also --grad-accumulation pair while accumulating), none "
                   "(--step-in-backward: each gradient freed in backward)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_config_flags(p, "memory", sections=("model",))
    p.set_defaults(func=cmd_memory)


# --------------------------------------------------------------------------------------------


def _out_dir(config: Config, command: str, suffix: str = "") -> str:
    return config.run.out or os.path.join("runs", f"{command}-{config.preset}{suffix}")


def _check_out(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out: {path!r} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--out: cannot create {path!r}: {error.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--out: {path!r} is not writable")


def _print(message: str) -> None:
    print(message, flush=True)


def cmd_compare(args: argparse.Namespace) -> int:
    config = config_from_args(args, "compare")
    if args.dry_run:
        print(format_plan(plan_of(config)))
        return 0
    if not config.run.report_only:
        # Fail fast, in the parent, on a device that is not there and on data that cannot
        # work (one line instead of a child's error, before minutes of tokenizing); this
        # also fills the BPE cache before the children read it.
        resolve_device(config.run.device)
        make_batches(load_corpus(config.data), config.data, context=config.model.context,
                     causal=is_causal(config.model.family), seed=config.run.seed)
    out = _out_dir(config, "compare")
    _check_out(out)
    if not config.run.quiet:
        runs = plan_runs(config)
        print(f"collage compare: preset {config.preset}, {len(runs)} runs of "
              f"{config.run.steps} steps -> {out}", flush=True)
        if config.run.seeds > 1 or config.run.lrs:
            print("strategies: " + ", ".join(config.run.strategy_list()), flush=True)
    compare(config, out, log=_print)
    if not config.run.quiet:
        print(f"wrote {out}/report.md, results.json, results.csv, history.json, plots")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    config = config_from_args(args, "train")
    strategy = config.optim.strategy
    out = _out_dir(config, "train", f"-{strategy}")
    created = not os.path.exists(out)
    _check_out(out)
    try:
        if config.run.nproc > 1 and not under_launcher():
            _check_nproc(config)
            return launch(config.run.nproc, args.argv)
        _train_into(config, strategy, out)
    except UsageError:  # refused before anything was written: no empty --out left behind
        if created and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
        raise
    return 0


def _train_into(config: Config, strategy: str, out: str) -> None:
    """Train (one process, or this rank of a launched job) and write the results to
    ``out`` (rank 0)."""
    log = None if config.run.quiet else _print
    try:
        result = train_strategy(
            config, strategy, out_dir=out, checkpoint_every=config.run.checkpoint_every,
            resume=config.run.resume, stop_after=config.run.stop_after, log=log,
            distributed=under_launcher(),
        )
        if result["ranks"].main:
            _write_train_results(config, out, result, log)
    finally:
        teardown()


def _check_nproc(config: Config) -> None:
    n = config.run.nproc
    if config.data.batch_size % n:
        raise UsageError(f"--nproc {n}: --batch-size {config.data.batch_size} must be "
                         f"divisible by it (every process takes an equal slice)")
    if resolve_device(config.run.device).type == "cuda" and torch.cuda.device_count() < n:
        raise UsageError(f"--nproc {n}: only {torch.cuda.device_count()} CUDA devices "
                         f"(one process per GPU)")


def _write_train_results(config: Config, out: str, result: dict[str, Any], log) -> None:
    strategy = config.optim.strategy
    s = result["summary"]
    write_json(os.path.join(out, "history.json"), result["history"])
    write_json(os.path.join(out, "summary.json"), s)
    if s["completed"]:
        save_atomic(_full_precision(result["model"], result["optimizer"]),
                    os.path.join(out, "model_fp32.pt"))
    if log:
        state = "finished" if s["completed"] else "stopped (resume with --resume)"
        log(f"{strategy}: {state} at step {s['steps']}/{config.run.steps}; "
            f"val loss {s['final_val_loss']:.4f} (ppl {s['final_val_ppl']:.2f}); "
            + (f"{s['tokens_per_s']:,.0f} tokens/s" if math.isfinite(s["tokens_per_s"])
               else "no step timed (the first steps are not)")
            + f"; output in {out}")


def _full_precision(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """The model's weights at full precision: what a collage optimizer's strategy
    represents (``consolidate``); a baseline's (torchao's 8-bit AdamW keeps nothing beside
    the weights) its model's own, exported as ``consolidate`` exports a tensor no strategy
    describes."""
    if isinstance(optimizer, CollageOptimizer):
        return consolidate(model, optimizer)
    return {key: full_precision_copy(value) for key, value in model.state_dict().items()}


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``"6.7e9"``, ``"7B"``, ``"125M"``, ``"350k"`` as a number; UsageError otherwise."""
    raw = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1.0
    if raw and raw[-1] in _SUFFIX:
        raw, scale = raw[:-1], _SUFFIX[raw[-1]]
    try:
        value = float(raw) * scale
    except ValueError:
        raise UsageError(f"--params: expected a number such as 6.7e9 or 7B, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"--params: must be a positive number, got {text!r}")
    return value


def _memory_params(args: argparse.Namespace) -> float:
    """--params, else the parameter count of the harness model that --preset and the model
    flags describe (built on the meta device: no memory, no initialisation), else 6.7e9."""
    model_flags = [k for k in vars(args) if k == "preset" or k.startswith("model.")]
    if args.params is not None:
        if model_flags:
            raise UsageError("--params and --preset/model flags both give the model size; "
                             "use one")
        return parse_count(args.params)
    if not model_flags:
        return 6.7e9
    config = config_from_args(args, "memory")
    with torch.device("meta"):
        model = build_model(config.model, vocab_size(config.data))  # BPE presets: theirs
    return float(sum(p.numel() for p in model.parameters()))


def _auto_range(grad_dtype: str) -> dict[str, float]:
    """Bytes per parameter of each rung of the autopilot's default ladder (AdamW)."""
    return {s.name: bytes_per_param(s.name, grad_dtype).total
            for s in Autopilot().rungs_for(ADAMW)}


def cmd_memory(args: argparse.Namespace) -> int:
    n = _memory_params(args)
    valid = strategies()
    chosen: list[str] = []
    for item in args.strategy or []:
        for name in filter(None, (x.strip() for x in item.split(","))):
            if name not in valid:
                raise UsageError(f"--strategy: unknown strategy {name!r}; valid: "
                                 + ", ".join(valid))
            if name not in chosen:
                chosen.append(name)
    chosen = chosen or [name for name in valid if name != AUTO]
    auto = AUTO in chosen  # (its bytes are decided in training: the ladder's range)
    chosen = [name for name in chosen if name != AUTO]
    if args.grad_dtype not in GRAD_DTYPES:
        raise UsageError(f"--grad-dtype: expected one of {', '.join(GRAD_DTYPES)}, got "
                         f"{args.grad_dtype!r}")
    if args.json:
        mixed = bytes_per_param(COMPARED_WITH, args.grad_dtype).total * n
        rows: list[dict[str, Any]] = []
        for name in chosen:
            b = bytes_per_param(name, args.grad_dtype)
            rows.append({**b.to_dict(), "total_bytes": b.total * n,
                         "saving_vs_mixed_bytes": mixed - b.total * n})
        extra = {"auto": _auto_range(args.grad_dtype)} if auto else {}
        json.dump({"params": n, "grad_dtype": args.grad_dtype, "strategies": rows, **extra},
                  sys.stdout, indent=1)
        print()
        return 0
    print(f"Persistent memory for {n:,.0f} parameters (gradients {args.grad_dtype}; "
          f"bytes per parameter; GB, MB, kB = 1e9, 1e6, 1e3 bytes; activations not "
          "included)")
    print()
    if chosen:
        print(memory_table(n, chosen, args.grad_dtype))
        print()
    if auto:
        ladder = _auto_range(args.grad_dtype)
        print("auto: each tensor at a rung of the ladder as its measured lost updates decide "
              "in training (docs/autopilot.md): " + " -> ".join(
                  f"{name} {b:g}" for name, b in ladder.items())
              + f" bytes per parameter, {min(ladder.values()) * n / 1e9:.2f} to "
              f"{max(ladder.values()) * n / 1e9:.2f} GB; a run's figure is in its report")
        print()
    print("weights: the model's weights (mixed: bf16 model + fp32 master); states: AdamW m and "
          "v; comp: compensation (Collage lo, Kahan buffer, split low bits, v lo); vs mixed: "
          "change of the total against mixed")
    return 0
