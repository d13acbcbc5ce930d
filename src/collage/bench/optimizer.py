"""``collage bench optimizer``: AdamW step time per strategy and path, against the roofline
and against torch.optim, optimi and torchao, on GPT-like parameter sets.

Fused rows say which backend ran (``backend``, and in the label): ``native`` (the C kernels
of ``collage.optim.native``, CPU) or ``inductor`` (torch.compile); ``COLLAGE_NATIVE=0``
benchmarks the inductor kernels on CPU.

Protocol, per size (a GPT-2-style list of tensors, :func:`common.gpt_shapes`):

* the baseline ``torch.optim.AdamW(fused=True)`` on float32 weights and two bandwidth probes
  (``dst.copy_(src)`` and ``a.add_(b)`` on float32 tensors of one element per parameter) live
  for the whole size;
* each candidate is built, warmed up (the first step compiles), then timed ``repeats`` times,
  *interleaved* with the baseline and the probes (the order rotates each round), so that a
  machine whose load changes affects all of them alike. Speed-ups are medians of the paired
  ratios; the roofline uses the bandwidth measured in the same rounds;
* the candidate is freed before the next one is built.

Collage rows run with ``nonfinite="ignore"`` (torch.optim, optimi and torchao do not check
gradients either); one extra row, ``plus+check``, shows the default ``nonfinite="skip"``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..optim import AdamW
from . import common
from .common import BYTES, DEFAULT_SIZES, SIZES

__all__ = ["register", "run", "Candidate", "candidates"]

STRATEGIES = ("fp32", "mixed", "bf16", "kahan", "stochastic", "light", "plus", "split")
LOW_PRECISION = tuple(s for s in STRATEGIES if s not in ("fp32", "mixed"))
PATHS = ("fused", "foreach", "reference")
BASELINES = ("torch-foreach-bf16", "optimi-kahan", "torchao-sr")
BASELINE_KEY = "torch-fused-fp32"
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


@dataclass
class Candidate:
    key: str  # row id: "collage:plus:fused", "torch-fused-fp32", ...
    label: str
    bytes_key: str
    weight_dtype: torch.dtype
    make: Callable[[list[torch.nn.Parameter]], Callable[[], object]]  # params -> step()
    path: str | None = None
    strategy: str | None = None


# ---------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------


def _collage(strategy: str, path: str, nonfinite: str = "ignore"):
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True},
             "reference": {"foreach": False}}[path]

    def make(params):
        opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            strategy=strategy, nonfinite=nonfinite, **flags)

        def step():
            return opt.step()

        step.optimizer = opt  # read back which fused backend ran (native or inductor)
        return step

    return make


def _torch(fused: bool):
    def make(params):
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=WEIGHT_DECAY, fused=fused or None,
                                foreach=None if fused else True)
        return opt.step

    return make


def _optimi_kahan(params):
    import optimi

    opt = optimi.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                       kahan_sum=True, foreach=True)
    return opt.step


def torchao_adamw():
    """torchao's plain AdamW with ``bf16_stochastic_round`` (``torchao.optim.AdamW`` in some
    releases, ``_AdamW`` in others; ``torchao.prototype.low_bit_optim`` before 0.8)."""
    for module_name in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            module = __import__(module_name, fromlist=["_"])
        except ImportError:
            continue
        for name in ("AdamW", "_AdamW"):
            cls = getattr(module, name, None)
            if cls is not None:
                return cls
    return None


def _torchao_sr(params):
    cls = torchao_adamw()
    opt = cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
              bf16_stochastic_round=True)
    return opt.step


def available_baselines() -> dict[str, str | None]:
    """baseline -> None when usable, else why not."""
    out: dict[str, str | None] = {"torch-foreach-bf16": None}
    try:
        import optimi  # noqa: F401

        out["optimi-kahan"] = None
    except ImportError:
        out["optimi-kahan"] = "not installed (pip install torch-optimi)"
    try:
        out["torchao-sr"] = None if torchao_adamw() is not None else \
            "torchao has no AdamW with bf16_stochastic_round"
    except Exception as error:  # a broken torchao install
        out["torchao-sr"] = f"import failed: {error}"
    return out


def candidates(strategies=STRATEGIES, paths=PATHS, baselines=BASELINES,
               check_row: bool = True) -> list[Candidate]:
    bf16, fp32 = torch.bfloat16, torch.float32
    rows: list[Candidate] = []
    usable = available_baselines()
    makers = {"torch-foreach-bf16": ("torch.optim.AdamW(foreach) bf16", _torch(False)),
              "optimi-kahan": ("optimi AdamW kahan_sum bf16", _optimi_kahan),
              "torchao-sr": ("torchao AdamW bf16_stochastic_round", _torchao_sr)}
    for key in baselines:
        if usable.get(key) is None:
            label, make = makers[key]
            rows.append(Candidate(key, label, key, bf16, make))
    for path in paths:
        for strategy in strategies:
            if path == "reference" and strategy not in LOW_PRECISION:
                continue  # fp32 and mixed: the reference *is* the float32 kernel
            label = f"collage {strategy} ({path})"
            if path == "reference":
                label += " = research algorithm"
            rows.append(Candidate(f"collage:{strategy}:{path}", label, strategy,
                                  fp32 if strategy == "fp32" else bf16,
                                  _collage(strategy, path), path, strategy))
    if check_row and "fused" in paths and "plus" in strategies:
        rows.append(Candidate("collage:plus:fused+check", "collage plus (fused, nonfinite="
                              "'skip', the default)", "plus", bf16,
                              _collage("plus", "fused", "skip"), "fused", "plus"))
    return rows


# ---------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------


def _params(shapes, dtype: torch.dtype, device: torch.device, seed: int):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
        g = torch.empty(shape, dtype=torch.float32).normal_(0.0, 1e-3, generator=generator)
        param = torch.nn.Parameter(p.to(device=device, dtype=dtype))
        param.grad = g.to(device=device, dtype=dtype)
        params.append(param)
    return params


def _timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> tuple[float, float]:
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - wall, time.process_time() - cpu

    return timed


class _Probes:
    """Streaming-bandwidth probes on float32 tensors of ``n`` elements."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.a = torch.ones(n, device=device)
        self.b = torch.full((n,), 0.5, device=device)
        self.n = n

    def copy(self):
        self.a.copy_(self.b)  # 8 bytes per element: read b, write a

    def add(self):
        self.a.add_(self.b)  # 12 bytes per element: read a and b, write a (in place)


def _optimizer_of(step) -> torch.optim.Optimizer | None:
    """The optimizer behind a candidate's ``step`` (a bound ``opt.step`` or our closure)."""
    opt = getattr(step, "optimizer", None) or getattr(step, "__self__", None)
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def _set_step_counter(step, value: int) -> bool:
    """Set every step counter of the optimizer behind ``step`` (per-parameter
    ``state["step"]``: torch, collage, torchao; per-group ``group["step"]``: optimi) to
    ``value``, so that the timed steps see the bias corrections of step ``value + 1``.
    False when no counter was found (the row then says so)."""
    opt = _optimizer_of(step)
    if opt is None:
        return False
    holders = [s for s in opt.state.values() if "step" in s] + \
        [g for g in opt.param_groups if "step" in g]
    for holder in holders:
        counter = holder["step"]
        if isinstance(counter, torch.Tensor):
            counter.fill_(value)
        else:
            holder["step"] = type(counter)(value)
    return bool(holders)


def _log(quiet: bool, *args) -> None:
    if not quiet:
        print(*args, file=sys.stderr, flush=True)


def measure_size(size: str, rows: list[Candidate], *, repeats: int, warmup: int,
                 device: torch.device, foreach_max: int, reference_max: int,
                 slow_repeats: int, quiet: bool, min_time: float = 0.5,
                 start_step: int = 0) -> dict:
    shapes = common.gpt_shapes(size)
    n = common.n_params(size)
    timed = _timer(device)
    _log(quiet, f"[{size}] {n / 1e6:.2f}M parameters in {len(shapes)} tensors")
    base_params = _params(shapes, torch.float32, device, seed=1)
    base_step = _torch(True)(base_params)
    probes = _Probes(n, device)
    for _ in range(warmup):
        base_step()
        probes.copy()
        probes.add()
    if start_step:
        _set_step_counter(base_step, start_step)
    out_rows = []
    samples = {"baseline": [], "copy": [], "add": []}
    for cand in rows:
        limit = {"foreach": foreach_max, "reference": reference_max}.get(cand.path or "")
        if limit is not None and n > limit:
            continue
        params = _params(shapes, cand.weight_dtype, device, seed=2)
        step = cand.make(params)
        started = time.perf_counter()
        first, _ = timed(step)  # includes compilation (in-process; FX graph cache on disk)
        counted = _set_step_counter(step, start_step) if start_step else None
        backend = getattr(getattr(step, "optimizer", None), "_fused_backend", None) \
            if cand.path == "fused" else None
        warm = [timed(step)[0] for _ in range(max(warmup - 1, 0))]
        if cand.path in ("foreach", "reference"):
            reps = slow_repeats
        else:  # short steps: more rounds, so that the medians mean something
            estimate = min(warm) if warm else first
            reps = max(repeats, min(200, int(min_time / max(estimate, 1e-6))))
        times, cpus, base, base_cpus, copies, adds = [], [], [], [], [], []
        work = [("c", step), ("b", base_step), ("copy", probes.copy), ("add", probes.add)]
        for r in range(reps):
            for name, fn in work[r % 4:] + work[:r % 4]:
                wall, cpu = timed(fn)
                if name == "c":
                    times.append(wall)
                    cpus.append(cpu)
                elif name == "b":
                    base.append(wall)
                    base_cpus.append(cpu)
                elif name == "copy":
                    copies.append(wall)
                else:
                    adds.append(wall)
        samples["baseline"] += base
        samples["copy"] += copies
        samples["add"] += adds
        bandwidth = max(8 * n / statistics.median(copies), 12 * n / statistics.median(adds))
        nbytes = BYTES[cand.bytes_key].total
        t = common.summary(times)
        row = {
            "size": size, "n_params": n, "key": cand.key, "label": cand.label,
            "path": cand.path, "strategy": cand.strategy, "backend": backend,
            "start_step": (start_step if counted else None) if start_step else 0,
            "bytes_per_param": nbytes, "first_step_s": first, "repeats": reps, "time_s": t,
            "cpu_time_median_s": statistics.median(cpus),
            "ns_per_param": {k: t[k] / n * 1e9 for k in ("median", "p90")},
            "GBps": nbytes * n / t["median"] / 1e9,
            "roofline_s": nbytes * n / bandwidth,
            "roofline_fraction": nbytes * n / bandwidth / t["median"],
            "bandwidth_GBps": bandwidth / 1e9,
            "baseline_median_s": statistics.median(base),
            "speedup_vs_torch_fused": statistics.median(b / c for b, c in zip(base, times)),
            "speedup_vs_torch_fused_cpu": statistics.median(
                b / max(c, 1e-9) for b, c in zip(base_cpus, cpus)),
        }
        out_rows.append(row)
        if backend:
            row["label"] = f"{cand.label[:-1]}, {backend})"  # "collage plus (fused, native)"
        _log(quiet, f"[{size}] {row['label']:58s} {t['median'] * 1e3:9.2f} ms  "
             f"x{row['speedup_vs_torch_fused']:6.2f} vs torch fused  "
             f"{100 * row['roofline_fraction']:5.0f}% roofline  "
             f"({time.perf_counter() - started:.0f}s)")
        del step, params
        gc.collect()
    copy_bw = 8 * n / statistics.median(samples["copy"]) if samples["copy"] else None
    add_bw = 12 * n / statistics.median(samples["add"]) if samples["add"] else None
    base_row = None
    if samples["baseline"]:
        t = common.summary(samples["baseline"])
        bandwidth = max(copy_bw, add_bw)
        nbytes = BYTES[BASELINE_KEY].total
        base_row = {
            "size": size, "n_params": n, "key": BASELINE_KEY,
            "label": "torch.optim.AdamW(fused) fp32", "path": None, "strategy": None,
            "bytes_per_param": nbytes, "time_s": t,
            "ns_per_param": {k: t[k] / n * 1e9 for k in ("median", "p90")},
            "GBps": nbytes * n / t["median"] / 1e9, "roofline_s": nbytes * n / bandwidth,
            "roofline_fraction": nbytes * n / bandwidth / t["median"],
            "bandwidth_GBps": bandwidth / 1e9, "baseline_median_s": t["median"],
            "speedup_vs_torch_fused": 1.0, "speedup_vs_torch_fused_cpu": 1.0,
        }
    del base_params, base_step, probes
    gc.collect()
    return {
        "size": size, "n_params": n, "n_tensors": len(shapes),
        "copy_GBps": copy_bw / 1e9 if copy_bw else None,
        "add_GBps": add_bw / 1e9 if add_bw else None,
        "rows": ([base_row] if base_row else []) + out_rows,
    }


# ---------------------------------------------------------------------------------------
# first-step (compile) cost across processes
# ---------------------------------------------------------------------------------------

_PROBE = """
import json, sys, time, torch, collage
from collage.bench.common import gpt_shapes
from collage.bench.optimizer import _params
torch.set_num_threads(int(sys.argv[2]))
out = {}
for strategy in sys.argv[1].split(","):
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    params = _params(gpt_shapes("small"), dtype, torch.device("cpu"), seed=0)
    opt = AdamW(params, strategy=strategy, fused=True, nonfinite="ignore")
    t = time.perf_counter(); opt.step(); first = time.perf_counter() - t
    t = time.perf_counter(); opt.step(); second = time.perf_counter() - t
    out[strategy] = {"first_step_s": first, "second_step_s": second}
print(json.dumps(out))
"""


def compile_cost(strategies, quiet: bool) -> dict:
    """First fused step per strategy in a fresh process with empty inductor and native-kernel
    caches (cold), then in another fresh process with the caches the first one filled
    (warm)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="collage-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, COLLAGE_CACHE_DIR=cache)
        for phase in ("cold", "warm"):
            _log(quiet, f"[compile] {phase} process ({len(strategies)} strategies)")
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", _PROBE, ",".join(strategies),
                                   str(torch.get_num_threads())],
                                  env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"compile probe failed:\n{done.stderr[-2000:]}")
            results[phase] = json.loads(done.stdout.strip().splitlines()[-1])
            results[phase + "_process_s"] = time.perf_counter() - started
    return results


# ---------------------------------------------------------------------------------------
# acceptance summary
# ---------------------------------------------------------------------------------------


def _row(rows, size, key):
    return next((r for r in rows if r["size"] == size and r["key"] == key), None)


def checks(result: dict) -> list[dict]:
    """The issue's acceptance criteria, evaluated on this run (ratios of medians)."""
    rows = [r for s in result["sizes"] for r in s["rows"]]
    sizes = [s["size"] for s in result["sizes"]]
    out = []

    def add(name, size, value, target, holds, cpu_value=None):
        out.append({"check": name, "size": size, "value": value, "target": target,
                    "holds": bool(holds), "value_cpu_time": cpu_value})

    for size in sizes:
        n = common.n_params(size)
        big = n >= 16_000_000
        for strategy, target in (("light", 1.4), ("plus", 1.2)):
            r = _row(rows, size, f"collage:{strategy}:fused")
            if r and big:
                add(f"{strategy} fused vs torch fused fp32 (speed-up)", size,
                    r["speedup_vs_torch_fused"], target, r["speedup_vs_torch_fused"] >= target,
                    r["speedup_vs_torch_fused_cpu"])
        if big:
            for strategy in STRATEGIES:
                r = _row(rows, size, f"collage:{strategy}:fused")
                if r:
                    add(f"{strategy} fused roofline fraction", size, r["roofline_fraction"],
                        0.8, r["roofline_fraction"] >= 0.8)
        for strategy, target in (("light", 10.0), ("plus", 50.0)):
            fast = _row(rows, size, f"collage:{strategy}:fused")
            ref = _row(rows, size, f"collage:{strategy}:reference")
            if fast and ref:
                ratio = fast["speedup_vs_torch_fused"] / ref["speedup_vs_torch_fused"]
                cpu = fast["speedup_vs_torch_fused_cpu"] / ref["speedup_vs_torch_fused_cpu"]
                add(f"{strategy} fused vs research algorithm (reference path)", size, ratio,
                    target, ratio >= target, cpu)
        for strategy, other in (("kahan", "optimi-kahan"), ("stochastic", "torchao-sr")):
            fast = _row(rows, size, f"collage:{strategy}:fused")
            them = _row(rows, size, other)
            if fast and them:
                ratio = fast["speedup_vs_torch_fused"] / them["speedup_vs_torch_fused"]
                cpu = fast["speedup_vs_torch_fused_cpu"] / them["speedup_vs_torch_fused_cpu"]
                add(f"{strategy} fused vs {other} (speed-up)", size, ratio, 1.0, ratio >= 1.0,
                    cpu)
    return out


# ---------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def table(result: dict) -> str:
    """Markdown tables, one per size."""
    lines = []
    for block in result["sizes"]:
        bw = [f"copy {block['copy_GBps']:.1f} GB/s" if block.get("copy_GBps") else None,
              f"in-place add {block['add_GBps']:.1f} GB/s" if block.get("add_GBps") else None]
        lines.append(f"### {block['size']}: {block['n_params'] / 1e6:.2f}M parameters, "
                     f"{block['n_tensors']} tensors ({', '.join(b for b in bw if b)})")
        lines.append("")
        lines.append("| optimizer | B/param | median ms | p90 ms | ns/param | GB/s | "
                     "roofline | x torch fused | x torch fused (CPU time) |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in block["rows"]:
            t = r["time_s"]
            # a step counter --start-step could not set: this row timed a fresh optimizer
            late = " (fresh: no step counter found)" if r.get("start_step", 0) is None else ""
            lines.append(
                f"| {r['label']}{late} | {r['bytes_per_param']} | {_fmt_ms(t['median'])} | "
                f"{_fmt_ms(t['p90'])} | {r['ns_per_param']['median']:.3g} | "
                f"{r['GBps']:.2f} | {100 * r['roofline_fraction']:.0f}% | "
                f"{r['speedup_vs_torch_fused']:.3g} | {r['speedup_vs_torch_fused_cpu']:.3g} |")
        lines.append("")
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
    if result.get("checks"):
        lines.append("### Acceptance checks (this run)")
        lines.append("")
        lines.append("| check | size | value (wall) | value (CPU time) | target | holds |")
        lines.append("|---|---|---:|---:|---:|---|")
        for c in result["checks"]:
            cpu = c.get("value_cpu_time")
            lines.append(f"| {c['check']} | {c['size']} | {c['value']:.3g} | "
                         f"{'' if cpu is None else format(cpu, '.3g')} | "
                         f">= {c['target']:g} | {'yes' if c['holds'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    env = result["environment"]
    start = result["settings"].get("start_step", 0)
    head = [
        f"# Optimizer step benchmark: {env['cpu']}, {env['cores']} cores, {env['date']}",
        "",
        f"python {env['python']}, torch {env['torch']}, collage {env['collage']}, "
        f"torch-optimi {env['optimi']}, torchao {env['torchao']}; {env['threads']} torch "
        f"threads; load average at start {env.get('load_average')}.",
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
                   help="collage strategies (default: all)")
    p.add_argument("--paths", default=",".join(PATHS), metavar="NAMES",
                   help="collage paths: fused, foreach, reference (default: all)")
    p.add_argument("--baselines", default=",".join(BASELINES), metavar="NAMES",
                   help="other optimizers beside torch fused AdamW: "
                        f"{', '.join(BASELINES)} (default: all installed)")
    p.add_argument("--foreach-max", type=float, default=2e6, metavar="N",
                   help="run the foreach path only up to N parameters (default 2e6)")
    p.add_argument("--reference-max", type=float, default=2e5, metavar="N",
                   help="run the reference path only up to N parameters (default 2e5: "
                        "it takes ~10 s per million parameters)")
    p.add_argument("--slow-repeats", type=int, default=2,
                   help="timed steps of the foreach and reference paths (default 2)")
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
    if args.paths != ",".join(PATHS):
        words.append(f"--paths {args.paths}")
    if args.baselines != ",".join(BASELINES):
        words.append(f"--baselines {args.baselines}")
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
    strategies = _csv(args.strategies, STRATEGIES, "--strategies")
    paths = _csv(args.paths, PATHS, "--paths")
    baselines = _csv(args.baselines, BASELINES, "--baselines") if args.baselines else ()
    if args.repeats < 1 or args.slow_repeats < 1:
        raise UsageError("--repeats and --slow-repeats must be at least 1")
    if args.warmup < 1:
        raise UsageError("--warmup must be at least 1 (the first step compiles)")
    if args.start_step < 0:
        raise UsageError("--start-step must be at least 0")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    result = run(sizes=sizes, strategies=strategies, paths=paths, baselines=baselines,
                 repeats=args.repeats, warmup=args.warmup, device=device,
                 foreach_max=int(args.foreach_max), reference_max=int(args.reference_max),
                 slow_repeats=args.slow_repeats, compile_probe=args.compile_cost,
                 min_time=args.min_time, start_step=args.start_step,
                 quiet=args.quiet or args.json, argv=_command(args))
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown(result))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
    return 0


def run(*, sizes=DEFAULT_SIZES, strategies=STRATEGIES, paths=PATHS, baselines=BASELINES,
        repeats=5, warmup=2, device=torch.device("cpu"), foreach_max=2_000_000,
        reference_max=200_000, slow_repeats=2, compile_probe=False, quiet=True,
        argv=(), min_time=0.5, start_step=0) -> dict:
    """Run the benchmark; returns the JSON-able result."""
    rows = candidates(strategies, paths, baselines)
    env = common.environment()
    result = {
        "environment": env,
        "settings": {"sizes": list(sizes), "repeats": repeats, "warmup": warmup,
                     "slow_repeats": slow_repeats, "foreach_max": foreach_max,
                     "reference_max": reference_max, "device": str(device),
                     "min_time": min_time, "start_step": start_step,
                     "argv": list(argv), "lr": LR, "betas": BETAS, "eps": EPS,
                     "weight_decay": WEIGHT_DECAY},
        "bytes_per_param": {k: {"read": b.read, "write": b.write, "total": b.total,
                                "components": b.components} for k, b in BYTES.items()},
        "unavailable": {k: v for k, v in available_baselines().items()
                        if v is not None and k in baselines},
        "sizes": [],
    }
    for size in sizes:
        result["sizes"].append(measure_size(
            size, rows, repeats=repeats, warmup=warmup, device=device,
            foreach_max=foreach_max, reference_max=reference_max,
            slow_repeats=slow_repeats, quiet=quiet, min_time=min_time,
            start_step=start_step))
    if compile_probe:
        fused = [s for s in strategies] if "fused" in paths else []
        if fused:
            result["compile"] = compile_cost(fused, quiet)
    result["checks"] = checks(result)
    return result
