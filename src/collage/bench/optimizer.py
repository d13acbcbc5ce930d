"""``collage bench optimizer``: AdamW step time per strategy and path, against the roofline
and against torch.optim, optimi and torchao, on GPT-like parameter sets.

What is timed is ``collage.bench.candidates``; how, ``collage.bench.measure`` (interleaved
with torch's fused AdamW and bandwidth probes, per size). Every collage row says which path
ran (``backend``: ``optimizer.last_paths``, ``collage.optim.dispatch``); fused rows also in
their label: ``native`` (the C kernels of ``collage.optim.native``, CPU) or ``compiled``
(torch.compile); ``COLLAGE_NATIVE=0`` benchmarks the compiled kernels on CPU. The
``reference`` rows run ``reference=True``, the research algorithm op by op.
"""

from __future__ import annotations

import argparse
import json
import textwrap

import torch

from ..errors import UsageError
from ..optim import STRATEGIES as ALL_STRATEGIES
from . import common
from .candidates import (
    BASELINES,
    BETAS,
    DEFAULT_NONFINITE,
    DEFAULT_PATHS,
    EPS,
    LR,
    NONFINITE,
    PATHS,
    STRATEGIES,
    WEIGHT_DECAY,
    Candidate,
    available_baselines,
    candidates,
)
from .common import BYTES, DEFAULT_SIZES, SIZES
from .measure import Settings, compile_cost, measure_size

__all__ = ["register", "run", "Candidate", "candidates", "table", "markdown"]


# ---------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------


#: what the ratio column is (printed under every table)
RATIO_NOTE = (
    "x torch fused: the median over the row's rounds of torch's fused step time over the "
    "row's, both timed in the same round; the torch fused row's median is over every round "
    "of the size, so compare a row's ratio with its own same-rounds column (the two agree "
    "within the spread of the per-round ratios, `speedup_range` in the JSON). B/param: "
    "what a step must move per parameter, the non-finite check's read of every gradient "
    "included where the row checks (`nonfinite=\"skip\"`, the default: "
    "`check_bytes_per_param` in the JSON); the roofline is those bytes over the measured "
    "copy or in-place add bandwidth, whichever is higher. load before / after: the "
    "1-minute load average before and after the row's rounds (for torch's fused row, the "
    "size's); the bench's own threads count in it as the run goes on, so a value well above "
    "the threads in use means other work shared the cores.")


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def table(result: dict) -> str:
    """Markdown tables, one per size; first the warning of a busy machine, if any."""
    lines = common.busy_lines(result)
    for block in result["sizes"]:
        bw = [f"copy {block['copy_GBps']:.1f} GB/s" if block.get("copy_GBps") else None,
              f"in-place add {block['add_GBps']:.1f} GB/s" if block.get("add_GBps") else None]
        lines.append(f"### {block['size']}: {block['n_params'] / 1e6:.2f}M parameters, "
                     f"{block['n_tensors']} tensors ({', '.join(b for b in bw if b)})")
        lines.append("")
        lines.append("| optimizer | B/param | median ms | p90 ms | ns/param | GB/s | "
                     "roofline | torch fused ms, same rounds | x torch fused | "
                     "x torch fused (CPU time) | load before | load after |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in block["rows"]:
            t = r["time_s"]
            # a step counter --start-step could not set: this row timed a fresh optimizer
            late = " (fresh: no step counter found)" if r.get("start_step", 0) is None else ""
            load = r.get("load_average") or {}
            lines.append(
                f"| {r['label']}{late} | {r['bytes_per_param']} | {_fmt_ms(t['median'])} | "
                f"{_fmt_ms(t['p90'])} | {r['ns_per_param']['median']:.3g} | "
                f"{r['GBps']:.2f} | {100 * r['roofline_fraction']:.0f}% | "
                f"{_fmt_ms(r['baseline_median_s'])} | "
                f"{r['speedup_vs_torch_fused']:.3g} | {r['speedup_vs_torch_fused_cpu']:.3g} | "
                f"{common.load_1m(load.get('before'))} | {common.load_1m(load.get('after'))} |")
        lines += ["", RATIO_NOTE, ""]
        looped = [r for r in block["rows"] if "loop_speedup_vs_torch_fused" in r]
        if looped:
            lines += _loop_table(looped)
    if result.get("compile"):
        c = result["compile"]
        lines.append("### First step (compilation), fresh processes, `small` size")
        lines.append("")
        lines.append("| strategy | cold cache s | warm cache s | steady step ms |")
        lines.append("|---|---:|---:|---:|")
        for strategy, cold in c["cold"].items():
            warm = c["warm"].get(strategy, {})
            lines.append(f"| {strategy} | {cold['first_step_s']:.1f} | "
                         f"{warm.get('first_step_s', float('nan')):.1f} | "
                         f"{1e3 * warm.get('second_step_s', float('nan')):.2f} |")
        lines.append("")
    return "\n".join(lines)


#: what the loop table is (printed under it)
LOOP_NOTE = (
    "In a loop: each side's steps run back to back, one synchronisation after the last "
    "(`measure.LOOP_STEPS` steps, loops alternating `measure.LOOP_REPEATS` times), as a "
    "training loop runs them: a step that never waits for the device lets the host prepare "
    "the next one meanwhile, so the slower of host and device sets the pace. The table "
    "above synchronises around every step and adds the two.")


def _loop_table(rows: list[dict]) -> list[str]:
    """The rows' steps timed in a loop (CUDA: ``measure._looped``)."""
    lines = ["| optimizer | ms per step in a loop | torch fused ms, same loops | "
             "x torch fused, in a loop |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label']} | {_fmt_ms(r['loop_time_s'])} | "
                     f"{_fmt_ms(r['loop_baseline_s'])} | "
                     f"{r['loop_speedup_vs_torch_fused']:.3g} |")
    return lines + ["", LOOP_NOTE, ""]


def markdown(result: dict) -> str:
    env = result["environment"]
    start = result["settings"].get("start_step", 0)
    head = [
        f"# Optimizer step benchmark: {env['cpu']}, {env['cores']} cores, {env['date']}",
        "",
        f"python {env['python']}, torch {env['torch']}, collage {env['collage']}, "
        f"torch-optimi {env['optimi']}, torchao {env['torchao']}; torch's CPU capability "
        f"{env.get('cpu_capability', 'not recorded')}; {env['threads']} torch threads; load "
        f"average at start {env.get('load_average')}.",
        "",
        "Command: `collage bench optimizer " + " ".join(result["settings"]["argv"]) + "`",
        "",
    ]
    if start:
        head += [f"Timed steps follow step {start} (step counters set after the first step): "
                 "the bias corrections of late training.", ""]
    return "\n".join(head) + table(result)


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------


def _csv(text: str, valid: tuple[str, ...], flag: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    for item in items:
        if item not in valid:
            raise UsageError(f"{flag}: unknown value {item!r}; valid: {', '.join(valid)}")
    return items


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "optimizer",
        help="AdamW step time per strategy and path vs torch.optim, optimi, torchao",
        description=textwrap.dedent("""\
            Time one AdamW step on GPT-like parameter sets (many [d] vectors, few [d,4d]
            matrices) for every strategy and path, interleaved with torch.optim.AdamW
            (fused=True, float32 weights) and with bandwidth probes measured in the same
            rounds. Reports median and p90 step time, ns per parameter, achieved GB/s (bytes
            a step must move / time) and the fraction of the roofline (those bytes / the
            best of copy_ and in-place add_ bandwidth)."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default=",".join(DEFAULT_SIZES), metavar="NAMES",
                   help=f"comma-separated sizes: {', '.join(SIZES)} "
                        f"(default: {','.join(DEFAULT_SIZES)})")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per row (default 5)")
    p.add_argument("--min-time", type=float, default=0.5, metavar="S",
                   help="time each fused/baseline row for at least about S seconds (more "
                        "rounds than --repeats for short steps; default 0.5, at most 200)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first, compilation included (default 2)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), metavar="NAMES",
                   help=f"collage strategies: {', '.join(ALL_STRATEGIES)} (default: "
                        f"{','.join(STRATEGIES)})")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS), metavar="NAMES",
                   help=f"collage paths: {', '.join(PATHS)} (default: "
                        f"{','.join(DEFAULT_PATHS)})")
    p.add_argument("--baselines", default=",".join(BASELINES), metavar="NAMES",
                   help="other optimizers beside torch fused AdamW: "
                        f"{', '.join(BASELINES)} (default: all installed)")
    p.add_argument("--nonfinite", default=",".join(NONFINITE), metavar="POLICIES",
                   help=f"non-finite policies to time: every row runs the default "
                        f"({DEFAULT_NONFINITE}: one more read of the gradients); the fused "
                        f"path also runs each other one listed: ignore is no check, the cost "
                        f"of a step after optimizer.clip_grad_norm_ (default: "
                        f"{','.join(NONFINITE)})")
    p.add_argument("--foreach-max", type=float, default=2e6, metavar="N",
                   help="run the foreach and per_tensor paths only up to N parameters "
                        "(default 2e6)")
    p.add_argument("--reference-max", type=float, default=2e5, metavar="N",
                   help="run the reference path only up to N parameters (default 2e5: "
                        "op by op, it is by far the slowest)")
    p.add_argument("--slow-repeats", type=int, default=2,
                   help="timed steps of the foreach, per_tensor and reference paths "
                        "(default 2)")
    p.add_argument("--start-step", type=int, default=0, metavar="N",
                   help="time the steps after step N (every optimizer's step counters set "
                        "to N after its first step): the bias corrections of late training, "
                        "where the native kernels skip a division (default 0: fresh "
                        "optimizers)")
    p.add_argument("--compile-cost", action="store_true",
                   help="also time the first fused step in fresh processes with a cold and a "
                        "warm inductor cache")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write a markdown report there")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_optimizer)


def _command(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce this run."""
    words = [f"--size {args.size}", f"--repeats {args.repeats}", f"--warmup {args.warmup}",
             f"--min-time {args.min_time:g}"]
    if args.strategies != ",".join(STRATEGIES):
        words.append(f"--strategies {args.strategies}")
    if args.paths != ",".join(DEFAULT_PATHS):
        words.append(f"--paths {args.paths}")
    if args.baselines != ",".join(BASELINES):
        words.append(f"--baselines {args.baselines or chr(34) * 2}")  # "": none
    if args.nonfinite != ",".join(NONFINITE):
        words.append(f"--nonfinite {args.nonfinite or chr(34) * 2}")
    words += [f"--foreach-max {args.foreach_max:g}", f"--reference-max {args.reference_max:g}",
              f"--slow-repeats {args.slow_repeats}"]
    if args.start_step:
        words.append(f"--start-step {args.start_step}")
    if args.compile_cost:
        words.append("--compile-cost")
    if args.threads:
        words.append(f"--threads {args.threads}")
    return words


def cmd_optimizer(args: argparse.Namespace) -> int:
    sizes = _csv(args.size, tuple(SIZES), "--size")
    strategies = _csv(args.strategies, ALL_STRATEGIES, "--strategies")
    paths = _csv(args.paths, PATHS, "--paths")
    baselines = _csv(args.baselines, BASELINES, "--baselines") if args.baselines else ()
    nonfinite = _csv(args.nonfinite, NONFINITE, "--nonfinite") if args.nonfinite else ()
    if args.repeats < 1 or args.slow_repeats < 1:
        raise UsageError("--repeats and --slow-repeats must be at least 1")
    if args.warmup < 1:
        raise UsageError("--warmup must be at least 1 (the first step compiles)")
    if args.start_step < 0:
        raise UsageError("--start-step must be at least 0")
    if not 0 <= args.min_time <= 200:  # (nan fails too)
        raise UsageError(f"--min-time must be between 0 and 200 seconds, got {args.min_time:g}")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    device = common.device_argument(args.device)
    common.check_writable(args.markdown, "--markdown")
    result = run(sizes=sizes, strategies=strategies, paths=paths, baselines=baselines,
                 nonfinite=nonfinite, repeats=args.repeats, warmup=args.warmup, device=device,
                 foreach_max=int(args.foreach_max), reference_max=int(args.reference_max),
                 slow_repeats=args.slow_repeats, compile_probe=args.compile_cost,
                 min_time=args.min_time, start_step=args.start_step,
                 quiet=args.quiet or args.json, argv=_command(args))
    # printed first: the results survive a markdown file that cannot be written after all
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown(result))
    return 0


def run(*, sizes=DEFAULT_SIZES, strategies=STRATEGIES, paths=DEFAULT_PATHS,
        baselines=BASELINES, nonfinite=NONFINITE, repeats=5, warmup=2,
        device=torch.device("cpu"),
        foreach_max=2_000_000, reference_max=200_000, slow_repeats=2, compile_probe=False,
        quiet=True, argv=(), min_time=0.5, start_step=0) -> dict:
    """Run the benchmark; returns the JSON-able result."""
    # before anything runs, so that the bench's own threads are not in it
    load = common.load_check(torch.get_num_threads())
    common.warn_if_busy(load)
    rows = candidates(strategies, paths, baselines, nonfinite)
    settings = Settings(repeats=repeats, warmup=warmup, device=device,
                        foreach_max=foreach_max, reference_max=reference_max,
                        slow_repeats=slow_repeats, quiet=quiet, min_time=min_time,
                        start_step=start_step)
    result = {
        "environment": common.environment(),
        "load": load,
        "settings": {"sizes": list(sizes), "repeats": repeats, "warmup": warmup,
                     "slow_repeats": slow_repeats, "foreach_max": foreach_max,
                     "reference_max": reference_max, "device": str(device),
                     "min_time": min_time, "start_step": start_step,
                     "nonfinite": list(nonfinite), "argv": list(argv), "lr": LR,
                     "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "bytes_per_param": {k: {"read": b.read, "write": b.write, "total": b.total,
                                "components": b.components} for k, b in BYTES.items()},
        "unavailable": {k: v for k, v in available_baselines().items()
                        if v is not None and k in baselines},
        "sizes": [measure_size(size, rows, settings) for size in sizes],
    }
    if compile_probe and "fused" in paths and strategies:
        result["compile"] = compile_cost(list(strategies), quiet)
    return result
