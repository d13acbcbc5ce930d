"""Shared pieces of the benchmarks: model shapes, bytes moved per parameter, the machine, and
robust timing summaries."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from dataclasses import dataclass
from importlib import metadata

import torch

__all__ = [
    "SIZES",
    "DEFAULT_SIZES",
    "gpt_shapes",
    "BYTES",
    "bytes_per_param",
    "environment",
    "hardware_slug",
    "summary",
]


# ---------------------------------------------------------------------------------------
# GPT-like parameter shapes
# ---------------------------------------------------------------------------------------

# name: (d_model, layers, vocab, context). Parameter counts (printed by `bench optimizer`):
# small 0.17M, 1m 1.1M, 16m 17M, 100m 111M (GPT-2 small's blocks with a 32k vocabulary).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (64, 2, 1024, 128),
    "1m": (128, 4, 2048, 256),
    "16m": (512, 4, 8192, 512),
    "100m": (768, 12, 32768, 1024),
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
    component once (in-place updates: read + write; the gradient: read only)."""

    read: int
    write: int
    components: str

    @property
    def total(self) -> int:
        return self.read + self.write


# Weights and gradients in bf16 (2 bytes) unless the row says fp32.
BYTES: dict[str, Bytes] = {
    "fp32": Bytes(16, 12, "w, m, v fp32 (r+w); g fp32 (r)"),
    "mixed": Bytes(14, 14, "master, m, v fp32 (r+w); g bf16 (r); w bf16 (w only)"),
    "bf16": Bytes(8, 6, "w, m, v bf16 (r+w); g bf16 (r)"),
    "stochastic": Bytes(8, 6, "as bf16; uniforms hashed in registers, not stored"),
    "kahan": Bytes(10, 8, "w, compensation, m, v bf16 (r+w); g (r)"),
    "light": Bytes(10, 8, "w, w_lo, m, v bf16 (r+w); g (r)"),
    "plus": Bytes(12, 10, "w, w_lo, m, v, v_lo bf16 (r+w); g (r)"),
    "split": Bytes(12, 10, "w, low16 int16, m, v, v_lo bf16 (r+w); g (r)"),
    # baselines
    "torch-fused-fp32": Bytes(16, 12, "w, m, v fp32 (r+w); g fp32 (r)"),
    "torch-foreach-bf16": Bytes(8, 6, "w, m, v bf16 (r+w); g (r)"),
    "optimi-kahan": Bytes(10, 8, "w, kahan comp, m, v bf16 (r+w); g (r)"),
    "torchao-sr": Bytes(8, 6, "w, m, v bf16 (r+w); g (r)"),
}


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


def environment() -> dict[str, object]:
    """What produced the numbers: CPU, cores, threads, date, versions."""
    import collage

    env: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "collage": collage.__version__,
        "optimi": _version("torch-optimi"),
        "torchao": _version("torchao"),
        "platform": platform.platform(),
    }
    try:
        env["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


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
