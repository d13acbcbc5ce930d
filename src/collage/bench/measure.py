"""The measurements of ``collage bench optimizer``: one size's candidates timed interleaved
with torch's fused AdamW and two bandwidth probes, and the first step's cost in fresh
processes.

Per size (a GPT-2-style list of tensors, :func:`common.gpt_shapes`): the baseline
``torch.optim.AdamW(fused=True)`` on float32 weights and the probes (``dst.copy_(src)`` and
``a.add_(b)`` on float32 tensors of one element per parameter) live for the whole size; each
candidate is built, warmed up (the first step compiles), then timed round after round with
the baseline and the probes, the order rotating each round, so that a machine whose load
changes affects all of them alike. Speed-ups are medians of the paired ratios (the
baseline's step over the candidate's, in one round), reported beside the baseline's median in
the same rounds (:func:`_paired`); the roofline uses the bandwidth measured in the same
rounds. The candidate is freed before the next one
is built.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import common
from .candidates import BASELINE_KEY, Candidate, torch_adamw
from .common import BYTES

__all__ = ["make_params", "measure_size", "compile_cost"]

#: the candidate paths timed ``slow_repeats`` times (and only up to a size)
SLOW_PATHS = ("foreach", "per_tensor", "reference")


def make_params(shapes, dtype: torch.dtype, device: torch.device, seed: int
                ) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` with gradients: weights N(0, 0.02), gradients N(0, 1e-3),
    drawn in float32 from ``seed`` and converted to ``dtype``; on a GPU drawn there (by its
    generator: a billion CPU draws per candidate would take longer than its timing)."""
    where = device if device.type == "cuda" else torch.device("cpu")
    generator = torch.Generator(device=where).manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.empty(shape, dtype=torch.float32, device=where).normal_(
            0.0, 0.02, generator=generator)
        g = torch.empty(shape, dtype=torch.float32, device=where).normal_(
            0.0, 1e-3, generator=generator)
        param = torch.nn.Parameter(p.to(device=device, dtype=dtype))
        param.grad = g.to(device=device, dtype=dtype)
        params.append(param)
    return params


def _timer(device: torch.device) -> Callable[[Callable], tuple[float, float]]:
    """``timed(fn)``: (wall seconds, CPU seconds) of one call, synchronized around it."""
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

    def bandwidth(self, copies: list[float], adds: list[float]) -> float:
        """Bytes per second: the better of the two probes' medians."""
        return max(8 * self.n / statistics.median(copies), 12 * self.n / statistics.median(adds))


def optimizer_of(step) -> torch.optim.Optimizer | None:
    """The optimizer behind a candidate's ``step`` (a bound ``opt.step`` or our closure)."""
    opt = getattr(step, "optimizer", None) or getattr(step, "__self__", None)
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def _set_step_counter(step, value: int) -> bool:
    """Set every step counter of the optimizer behind ``step`` (per-parameter
    ``state["step"]``: torch, collage, torchao; per-group ``group["step"]``: optimi) to
    ``value``, so that the timed steps see the bias corrections of step ``value + 1``.
    False when no counter was found (the row then says so)."""
    opt = optimizer_of(step)
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


def _path_ran(step) -> str | None:
    """The path(s) a collage optimizer's last step ran (``optimizer.last_paths``); None
    for the other optimizers."""
    paths = getattr(optimizer_of(step), "last_paths", None)
    return "+".join(dict.fromkeys(paths.values())) if paths else None


def log(quiet: bool, *args) -> None:
    if not quiet:
        print(*args, file=sys.stderr, flush=True)


@dataclass
class Settings:
    """How one size is measured (``collage bench optimizer``'s flags)."""

    repeats: int
    warmup: int
    device: torch.device
    foreach_max: int
    reference_max: int
    slow_repeats: int
    quiet: bool
    min_time: float = 0.5
    start_step: int = 0


@dataclass
class _Baseline:
    """torch's fused AdamW on float32 weights and the bandwidth probes of one size, and
    every sample they gave."""

    params: list[torch.nn.Parameter]
    step: Callable
    probes: _Probes
    samples: dict[str, list[float]] = field(
        default_factory=lambda: {"baseline": [], "copy": [], "add": []})


def _start_baseline(shapes, n: int, settings: Settings) -> _Baseline:
    params = make_params(shapes, torch.float32, settings.device, seed=1)
    base = _Baseline(params, torch_adamw(True)(params), _Probes(n, settings.device))
    for _ in range(settings.warmup):
        base.step()
        base.probes.copy()
        base.probes.add()
    if settings.start_step:
        _set_step_counter(base.step, settings.start_step)
    return base


def _too_large(cand: Candidate, n: int, settings: Settings) -> bool:
    """The slow paths run only up to their size limit."""
    if cand.path == "reference":
        return n > settings.reference_max
    return cand.path in SLOW_PATHS and n > settings.foreach_max


def _rounds(cand: Candidate, warm: list[float], first: float, settings: Settings) -> int:
    """Timed rounds of a candidate: ``slow_repeats`` for the slow paths; short steps get
    more rounds (about ``min_time`` seconds, at most 200), so that the medians mean
    something."""
    if cand.path in SLOW_PATHS:
        return settings.slow_repeats
    estimate = min(warm) if warm else first
    return max(settings.repeats, min(200, int(settings.min_time / max(estimate, 1e-6))))


def _interleaved(step: Callable, base: _Baseline, rounds: int, timed) -> dict[str, list[float]]:
    """Wall (and CPU) seconds of the candidate, the baseline and the probes, each timed
    once per round, the order rotated every round."""
    times: dict[str, list[float]] = {"c": [], "c_cpu": [], "b": [], "b_cpu": [], "copy": [],
                                     "add": []}
    work = [("c", step), ("b", base.step), ("copy", base.probes.copy),
            ("add", base.probes.add)]
    for r in range(rounds):
        for name, fn in work[r % 4:] + work[:r % 4]:
            wall, cpu = timed(fn)
            times[name].append(wall)
            if name in ("c", "b"):
                times[name + "_cpu"].append(cpu)
    base.samples["baseline"] += times["b"]
    base.samples["copy"] += times["copy"]
    base.samples["add"] += times["add"]
    return times


#: steps per timed loop and loops per side (:func:`_looped`)
LOOP_STEPS, LOOP_REPEATS = 10, 3


def _looped(step: Callable, baseline: Callable, device: torch.device,
            steps: int = LOOP_STEPS, repeats: int = LOOP_REPEATS) -> dict:
    """The step's time in a loop, as training runs it: ``steps`` steps back to back with
    one synchronisation after the last (a step that never waits for the device lets the
    host prepare the next step while the device runs this one: the slower of the two sets
    the pace), per step; the candidate's and the baseline's loops alternate ``repeats``
    times. The isolated rounds (synchronised around every step) add the host's time to the
    device's instead; on a CPU the two are the same."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def per_step(fn: Callable) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        return (time.perf_counter() - start) / steps

    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(per_step(step))
        theirs.append(per_step(baseline))
    return {"loop_time_s": statistics.median(ours),
            "loop_baseline_s": statistics.median(theirs),
            "loop_speedup_vs_torch_fused": statistics.median(
                b / c for b, c in zip(theirs, ours)),
            "loop_steps": steps}


def check_bytes(cand: Candidate) -> int:
    """Bytes per parameter the candidate's non-finite check reads: each gradient once
    (the bench's gradients have the weights' dtype, ``make_params``) under every policy
    but ``ignore`` (the optimizer's one policy that checks nothing), else 0 (``ignore``,
    and the baselines, whose policy is None)."""
    return cand.weight_dtype.itemsize if cand.nonfinite not in (None, "ignore") else 0


def step_bytes(cand: Candidate) -> float:
    """What one step of ``cand`` must move per parameter, the roofline's numerator: its
    components read and written (``common.BYTES``) and its check's read (#31: the default
    configuration's roofline counts the check, which is part of its step)."""
    return BYTES[cand.bytes_key].total + check_bytes(cand)


def _speed_row(nbytes: float, n: int, t: dict[str, float], bandwidth: float) -> dict:
    """Time per parameter, achieved GB/s and the fraction of the roofline."""
    return {
        "bytes_per_param": nbytes, "time_s": t,
        "ns_per_param": {k: t[k] / n * 1e9 for k in ("median", "p90")},
        "GBps": nbytes * n / t["median"] / 1e9,
        "roofline_s": nbytes * n / bandwidth,
        "roofline_fraction": nbytes * n / bandwidth / t["median"],
        "bandwidth_GBps": bandwidth / 1e9,
    }


def _paired(base: list[float], cand: list[float]) -> dict:
    """The row's speed-up against the baseline timed in the same rounds: the median of the
    per-round ratios, their range, and the baseline's median over those rounds.

    What the ratio column can be compared with: the baseline's median *in the same rounds*
    (``baseline_median_s``), not the baseline row's median over every round of the size,
    which moves with the machine's load from one candidate's rounds to the next (#31: a
    plus row at 68.1 ms whose rounds saw the baseline at about 100 ms, not the 50.4 ms of
    the baseline row, printed 1.48). The median of the ratios and the ratio of the medians
    both lie in ``speedup_range`` (each round has ``b >= lo * c``, so ``median(b) >= lo *
    median(c)``; likewise ``hi``): they differ by at most its width."""
    ratios = [b / c for b, c in zip(base, cand)]
    return {"baseline_median_s": statistics.median(base),
            "speedup_vs_torch_fused": statistics.median(ratios),
            "speedup_range": [min(ratios), max(ratios)]}


def _measure_candidate(cand: Candidate, size: str, shapes, n: int, base: _Baseline,
                       settings: Settings) -> dict:
    """One candidate's row: built, warmed up, then timed interleaved with the baseline."""
    timed = _timer(settings.device)
    step = cand.make(make_params(shapes, cand.weight_dtype, settings.device, seed=2))
    started = time.perf_counter()
    first, _ = timed(step)  # includes compilation (in-process; FX graph cache on disk)
    start_step = settings.start_step
    counted = _set_step_counter(step, start_step) if start_step else None
    path_ran = _path_ran(step)
    warm = [timed(step)[0] for _ in range(max(settings.warmup - 1, 0))]
    rounds = _rounds(cand, warm, first, settings)
    load_before = common.load_average()
    times = _interleaved(step, base, rounds, timed)
    load = {"before": load_before, "after": common.load_average()}
    t = common.summary(times["c"])
    row = {
        "size": size, "n_params": n, "key": cand.key, "label": cand.label,
        "path": cand.path, "strategy": cand.strategy, "nonfinite": cand.nonfinite,
        "backend": path_ran,
        "start_step": (start_step if counted else None) if start_step else 0,
        "first_step_s": first, "repeats": rounds,
        "cpu_time_median_s": statistics.median(times["c_cpu"]),
        **_speed_row(step_bytes(cand), n, t,
                     base.probes.bandwidth(times["copy"], times["add"])),
        "check_bytes_per_param": check_bytes(cand),
        **_paired(times["b"], times["c"]),
        "speedup_vs_torch_fused_cpu": statistics.median(
            b / max(c, 1e-9) for b, c in zip(times["b_cpu"], times["c_cpu"])),
        # the 1, 5 and 15-minute load averages before and after the row's rounds: the
        # bench's own threads count in them (common.load_check)
        "load_average": load,
    }
    if settings.device.type == "cuda":  # the host may run ahead there (docs/gpu.md)
        row.update(_looped(step, base.step, settings.device))
    if cand.path == "fused" and path_ran:  # "collage plus (fused, native)"
        row["label"] = f"{cand.label[:-1]}, {path_ran})"
    log(settings.quiet, f"[{size}] {row['label']:58s} {t['median'] * 1e3:9.2f} ms  "
        f"x{row['speedup_vs_torch_fused']:6.2f} vs torch fused  "
        f"{100 * row['roofline_fraction']:5.0f}% roofline  "
        f"load {common.load_1m(load['before'])} -> {common.load_1m(load['after'])}  "
        f"({time.perf_counter() - started:.0f}s)")
    return row


def _baseline_row(size: str, n: int, base: _Baseline, load: dict) -> dict | None:
    """torch's fused AdamW over every round of the size (None when nothing was timed)."""
    if not base.samples["baseline"]:
        return None
    t = common.summary(base.samples["baseline"])
    bandwidth = base.probes.bandwidth(base.samples["copy"], base.samples["add"])
    return {
        "size": size, "n_params": n, "key": BASELINE_KEY,
        "label": "torch.optim.AdamW(fused) fp32", "path": None, "strategy": None,
        **_speed_row(BYTES[BASELINE_KEY].total, n, t, bandwidth),
        "baseline_median_s": t["median"], "speedup_range": [1.0, 1.0],
        "speedup_vs_torch_fused": 1.0, "speedup_vs_torch_fused_cpu": 1.0,
        "load_average": load,  # at the size's start and end: its rounds span the size
    }


def measure_size(size: str, rows: list[Candidate], settings: Settings) -> dict:
    """Every candidate of ``rows`` on the GPT-like parameter set ``size``."""
    shapes = common.gpt_shapes(size)
    n = common.n_params(size)
    log(settings.quiet, f"[{size}] {n / 1e6:.2f}M parameters in {len(shapes)} tensors")
    load_before = common.load_average()
    base = _start_baseline(shapes, n, settings)
    out_rows = []
    for cand in rows:
        if not _too_large(cand, n, settings):
            out_rows.append(_measure_candidate(cand, size, shapes, n, base, settings))
            gc.collect()  # the candidate's tensors, before the next one is built
    samples = base.samples
    copy_bw = 8 * n / statistics.median(samples["copy"]) if samples["copy"] else None
    add_bw = 12 * n / statistics.median(samples["add"]) if samples["add"] else None
    base_row = _baseline_row(size, n, base,
                             {"before": load_before, "after": common.load_average()})
    del base
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
from collage.bench.measure import make_params
from collage.optim import get_strategy
torch.set_num_threads(int(sys.argv[2]))
out = {}
for strategy in sys.argv[1].split(","):
    dtype = get_strategy(strategy).weight_dtypes[0]
    params = make_params(gpt_shapes("small"), dtype, torch.device("cpu"), seed=0)
    opt = collage.AdamW(params, strategy=strategy, fused=True, nonfinite="ignore")
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
            log(quiet, f"[compile] {phase} process ({len(strategies)} strategies)")
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", _PROBE, ",".join(strategies),
                                   str(torch.get_num_threads())],
                                  env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"compile probe failed:\n{done.stderr[-2000:]}")
            results[phase] = json.loads(done.stdout.strip().splitlines()[-1])
            results[phase + "_process_s"] = time.perf_counter() - started
    return results
