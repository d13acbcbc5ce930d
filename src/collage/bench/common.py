"""Shared pieces of the benchmarks: model shapes, bytes moved per parameter, the machine, and
robust timing summaries."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from importlib import metadata

import torch

from .. import __version__
from ..errors import UsageError
from ..optim.native.build import cpu_features
from ..optim.rules import ADAMW, Rule
from ..optim.strategies import Strategy, all_strategies
from ..optim.strategies.strategy import dtype_name
from ..train.memory import describe, whole

__all__ = [
    "SIZES",
    "DEFAULT_SIZES",
    "gpt_shapes",
    "BYTES",
    "BASELINE_BYTES",
    "bytes_per_param",
    "strategy_bytes",
    "environment",
    "cpu_kernels",
    "load_average",
    "load_check",
    "warn_if_busy",
    "busy_lines",
    "load_1m",
    "hardware_slug",
    "summary",
    "device_argument",
    "check_writable",
]


# ---------------------------------------------------------------------------------------
# GPT-like parameter shapes
# ---------------------------------------------------------------------------------------

# name: (d_model, layers, vocab, context). Parameter counts (printed by `bench optimizer`):
# small 0.17M, 1m 1.1M, 16m 17M, 100m 111M (GPT-2 small's blocks with a 32k vocabulary),
# 1b 1.01B (GPU runs: 16 GB for the float32 baseline alone).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (64, 2, 1024, 128),
    "1m": (128, 4, 2048, 256),
    "16m": (512, 4, 8192, 512),
    "100m": (768, 12, 32768, 1024),
    "1b": (2048, 18, 50304, 2048),
}
DEFAULT_SIZES = ("small", "1m", "16m", "100m")


def gpt_shapes(size: str) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter shapes of a GPT-2-style model (tied head): embeddings ``[V, d]`` and
    ``[T, d]``; per block two LayerNorms ``[d]`` x 2, ``c_attn [3d, d]`` + ``[3d]``,
    ``c_proj [d, d]`` + ``[d]``, ``c_fc [4d, d]`` + ``[4d]``, ``c_proj [d, 4d]`` + ``[d]``;
    the final LayerNorm. Many small vectors beside few large matrices, as in real models."""
    d, layers, vocab, context = SIZES[size]
    shapes = [("wte", (vocab, d)), ("wpe", (context, d))]
    for i in range(layers):
        h = f"h.{i}."
        shapes += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (3 * d, d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (4 * d, d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (d, 4 * d)), (h + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def n_params(size: str) -> int:
    return sum(torch.Size(shape).numel() for _, shape in gpt_shapes(size))


# ---------------------------------------------------------------------------------------
# bytes moved per parameter by one AdamW step (the roofline's numerator)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bytes:
    """Bytes one step must read and write per parameter element, at least: each stored
    component once (in-place updates: read + write; the gradient: read only). Whole numbers
    are ints."""

    read: float
    write: float
    components: str

    @property
    def total(self) -> float:
        return self.read + self.write


def strategy_bytes(strategy: Strategy, rule: Rule = ADAMW) -> Bytes:
    """The bytes a step of ``rule`` (AdamW) under ``strategy`` moves, from its components
    at its default weight dtype: every component written once and read once, except those a
    step does not read (``read=False``: mixed's visible weight, written from the master);
    the gradient, in the weight's dtype, read once."""
    weight_dtype = strategy.weight_dtypes[0]
    components = strategy.components(rule, weight_dtype)
    updated = [c for c in components if c.read]
    written_only = [c for c in components if not c.read]
    read = sum(c.bytes for c in updated) + weight_dtype.itemsize
    write = sum(c.bytes for c in components)
    text = f"{describe(updated, by_role=False)} (r+w)"
    if written_only:
        text += f"; {describe(written_only, by_role=False)} (w only)"
    text += f"; g {dtype_name(weight_dtype)} (r)"
    if strategy.draws:
        text += "; uniforms hashed in registers, not stored"
    return Bytes(whole(read), whole(write), text)


#: Optimizers benchmarked beside collage's that are not strategies: declared by hand.
#: Weights and gradients in bf16 (2 bytes) unless the row says fp32.
BASELINE_BYTES: dict[str, Bytes] = {
    "torch-fused-fp32": Bytes(16, 12, "w, m, v fp32 (r+w); g fp32 (r)"),
    "torch-foreach-bf16": Bytes(8, 6, "w, m, v bf16 (r+w); g (r)"),
    "torch-fused-bf16": Bytes(8, 6, "w, m, v bf16 (r+w); g (r)"),
    "optimi-kahan": Bytes(10, 8, "w, kahan comp, m, v bf16 (r+w); g (r)"),
    "torchao-sr": Bytes(8, 6, "w, m, v bf16 (r+w); g (r)"),
}

#: Every strategy's bytes (``collage.STRATEGIES`` order), then the baselines'.
BYTES: dict[str, Bytes] = {**{s.name: strategy_bytes(s) for s in all_strategies()},
                           **BASELINE_BYTES}


def bytes_per_param(key: str) -> Bytes:
    return BYTES[key]


# ---------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


#: The instruction sets, as /proc/cpuinfo names them, on which torch's CPU kernels choose
#: their code: ATen's vector kernels (``torch.backends.cpu.get_cpu_capability()``), oneDNN's
#: bf16 and float32 GEMMs (AVX-512 BF16, AMX) and MKL's. Two CPUs with the same model name
#: and the same ones run the same kernels; see docs/compare.md, "Which results depend on
#: the CPU".
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
#: Variables that override those choices (the emulation of another CPU sets them).
KERNEL_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                    "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def cpu_kernels() -> dict[str, object]:
    """What decides which of torch's CPU kernels run, and so the last bits of a float32 or
    bf16 computation on this machine: the CPU model, torch's CPU capability, the
    instruction sets of :data:`ISA_FLAGS` it has, and any of :data:`KERNEL_OVERRIDES` set."""
    flags = cpu_features()
    return {
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "overrides": {k: os.environ[k] for k in KERNEL_OVERRIDES if k in os.environ},
    }


def environment() -> dict[str, object]:
    """What produced the numbers: CPU (and what decides torch's kernels on it), cores,
    threads, date, versions, the load average when this is called."""
    kernels = cpu_kernels()
    env: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "cpu": kernels["cpu"],
        "cpu_capability": kernels["cpu_capability"],
        "isa": kernels["isa"],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "collage": __version__,
        "optimi": _version("torch-optimi"),
        "torchao": _version("torchao"),
        "platform": platform.platform(),
    }
    if kernels["overrides"]:
        env["kernel_overrides"] = kernels["overrides"]
    load = load_average()
    if load is not None:
        env["load_average"] = load
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


# ---------------------------------------------------------------------------------------
# a busy machine
# ---------------------------------------------------------------------------------------


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (``os.getloadavg``), None where there are
    none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


#: How far the load may exceed the cores before a bench warns: one runnable thread more
#: than the cores, on average. An idle machine's 1-minute load is not 0 (daemons, the
#: shell that starts the bench), and it remembers the last minute: a bench started within a
#: minute of another job (a build, an earlier bench) reads 0.5-0.9 on a quiet 2-core machine
#: (measured 2026-12-06); a few tenths of a core on average do not deschedule a thread for
#: long, another whole busy thread does (the issue's 27 ms against 416 ms rounds).
BUSY_MARGIN = 1.0


def load_check(threads: int, cores: int | None = None) -> dict[str, object]:
    """The load before a bench starts, and a warning (printed once on stderr by
    :func:`warn_if_busy`, kept in the result as ``load["warning"]``) when the machine is
    too busy for the bench's times to be the machine's.

    What the load average counts: the runnable threads of every process on the machine
    (running, or waiting for a core; on Linux also those in uninterruptible sleep),
    averaged with time constants of 1, 5 and 15 minutes. A bench running ``threads``
    threads adds up to ``threads`` to it while it runs, so a load read during the run
    counts the bench itself; read before the start, it is the other work alone. Every
    thread of the bench finds a core while that work and the bench together stay within
    the machine's cores (``os.cpu_count()``: the load is the whole machine's):
    ``before + threads <= cores``. Beyond, some thread waits for a core, and an OpenMP
    region waits for its slowest thread, so one descheduled thread stalls the whole step
    (#40: torch's fused step took 27 ms in some rounds and 416 ms in others while another
    process used the cores). Where the bench uses every core (torch's default), this is
    #40's rule "the load exceeds the threads in use", applied to the load the run will
    see, ``before + threads``; with fewer threads the idle cores absorb other work first.

    The 1-minute average remembers the last minute: a bench started right after another
    reads that one's load; wait a minute and start again."""
    cores = cores or os.cpu_count() or 1
    before = load_average()
    warning = None
    if before is not None and before[0] + threads > cores + BUSY_MARGIN:
        warning = (f"busy machine: the 1-minute load average was {before[0]:.2f} before the "
                   f"bench started; with the bench's {threads} thread"
                   f"{'s' if threads != 1 else ''} that makes {before[0] + threads:.2f} "
                   f"runnable threads for {cores} core{'s' if cores != 1 else ''} (more than "
                   f"{cores} + {BUSY_MARGIN:g}): threads will wait for a core and rounds will "
                   f"be slow for that alone, so these times are not the machine's. Each "
                   f"row's load is in the results; rerun on a quiet machine")
    return {"before": before, "threads": threads, "cores": cores, "margin": BUSY_MARGIN,
            "busy": warning is not None, "warning": warning}


def load_1m(load: list[float] | None) -> str:
    """The 1-minute figure of a :func:`load_average` for a table ("n/a" where none)."""
    return f"{load[0]:.2f}" if load else "n/a"


def busy_lines(result: dict) -> list[str]:
    """The markdown lines that open a busy run's tables: its warning, in bold."""
    warning = (result.get("load") or {}).get("warning")
    return [f"**Warning: {warning}.**", ""] if warning else []


def warn_if_busy(check: dict[str, object]) -> None:
    """Print :func:`load_check`'s warning on stderr (once per bench, quiet or not)."""
    if check.get("warning"):
        print(f"collage bench: warning: {check['warning']}", file=sys.stderr, flush=True)


def hardware_slug(env: dict[str, object]) -> str:
    """``<cpu>-<cores>c`` made file-name safe, for ``docs/benchmarks/<hardware>_<date>.md``."""
    name = str(env.get("gpu") or env["cpu"])
    for noise in ("(R)", "(TM)", "(tm)", "CPU", "Processor", "@"):
        name = name.replace(noise, " ")
    slug = "-".join(part for part in name.lower().replace("/", " ").split() if part)
    return f"{slug}-{env['cores']}c"


# ---------------------------------------------------------------------------------------
# timing summaries
# ---------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p90": percentile(values, 0.9),
            "min": min(values), "n": len(values)}


# ----------------------------------------------------------------------- the commands' flags

def device_argument(text: str) -> torch.device:
    """``--device`` as a device: a UsageError naming the flag for one torch does not know,
    one the benches do not run on, or CUDA on a machine without it."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {text!r}; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: the benches run on cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return device


def check_writable(path: str | None, flag: str) -> None:
    """Before a bench runs (minutes): ``path`` (``flag``'s, None: not given) can be written,
    its folder existing and writable and itself no folder; else a UsageError naming the
    flag, not an error after the results were measured."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag}: cannot write {path!r} (its folder must exist and be "
                         "writable, and it must not be a folder)")
