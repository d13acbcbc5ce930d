"""A model of the Triton optimizer step on a GPU, from the compiled code, on a machine with
no GPU (issue #29, docs/gpu.md "The model").

Triton compiles ``kernels.multi_tensor_step`` for an NVIDIA target without a GPU; its wheel
ships ``nvdisasm`` and ``cuobjdump``. For every kernel variant the launcher can choose (rule x
strategy at its default weight dtype; whole blocks and tails; the default configuration,
which leaves the non-finite verdict on the device, and ``nonfinite="ignore"``) and for
sm_90 (H100/H200) and sm_80 (A100) this script reads off the SASS:

* registers and spills (``cuobjdump -res-usage``: REG, LOCAL; LDL/STL instructions);
* the instructions a warp issues per tile on the fast path: the persistent loop's body (or,
  for a kernel without one, the whole kernel), without the IEEE square root's and
  division's slow paths (a predicated branch around a ``CALL``) and the subroutines;
  divided by the elements a thread steps per tile (BLOCK / threads);
* the global memory operations per tile by opcode (``LDG.E.128`` is a 16-byte vector);

* each instruction's control code (``nvdisasm -hex``: the stall count, the scoreboard its
  result sets, the one its operands' read releases, the scoreboards it waits on);

and predicts the fraction of the achievable HBM bandwidth a step reaches at 100M and 1B
parameters, from the variant each size's launch compiles (``launched_variants``: at 1B
every tensor is a multiple of ``BLOCK``, so no tails loop; at 100M both loops). Issue #44's
model, per SM and loop iteration (``tile_cycles``):

    data loads  = loads whose address depends on the thread's index (a tile's columns);
                  the uniform ones (tile list, table, coefficients) stay in L2 ("cached")
    one warp    = the loop run three times with the control codes (``loop_timing``): its
                  iteration alone, its waits included; the window (instructions issued
                  while one of its data loads is in flight); the bytes in flight at a wait
    memory      = the iteration's bytes / (achievable bandwidth / SMs)
    issue       = a warp's instructions / efficiency   (4 warps, one per scheduler)
    throughput  = memory + issue - min(memory, issue x window / instructions)
    latency     = one warp's iteration / resident programs (Little's law: each resident
                  warp keeps its own bytes in flight; ``bytes_in_flight_per_sm`` against
                  ``little_bytes_per_sm`` = bandwidth per SM x DRAM latency)
    iteration   = max(throughput, latency)
    step        = step kernel + check kernel (default) + host     "host added"
                = max(step kernel + check kernel, host)           "host hidden"
    predicted   = bytes moved (step's and check's) / achievable bandwidth / step

The efficiency is fitted to the one H200 run of the kernels before #29 (``calibrate``,
``--calibrate``: the kernels of ``H200_REVISION``, one tile a program): it
reproduces that run within 3 points, at any DRAM latency up to 4 us (that run was
throughput-bound, so it does not pin the latency: 700 ns is issue #44's figure, the
table's 300 clocks an assumption). The earlier roofline (``predict``: issue at the peak
rate, added to the memory time or hidden under it) stays in the rows as ``roofline_*``.
sm_80 rows use the H200's efficiency and latencies: uncalibrated.

Usage:
    python benchmarks/gpu_model.py [--arch 90,80] [--json] [--revision REV] [--no-host]
                                   [--host-seconds JSON] [--calibrate]

``--revision REV`` compiles the Triton kernels (``src/collage/optim/triton/kernels/``) as
they were at git revision REV (the "before" table). ``--json`` prints one object per
variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

import collage
from collage.bench.common import strategy_bytes
from collage.optim import get_strategy
from collage.optim.rules import RULES
from collage.optim.triton import launch as launches
from collage.optim.triton import layout

# The model's parts live beside this file (gpu_sass: compiling and reading the SASS;
# gpu_timing: the warp and the step; gpu_host: the host's time). Run as a script, this
# folder is already first on the path; loaded by its path (the tests, importlib) it is not.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Besides what this file uses, the names the tests and benchmarks/host_time.py read from
# ``gpu_model`` (they predate the split): ``control``, ``Sass``, ``loop_timing``,
# ``_check_as_on_a_gpu``, ...
from gpu_host import (  # noqa: E402 - after this folder is on the path
    LAUNCH_HOST_S, _check_as_on_a_gpu, host_seconds, host_seconds_on_gpu)
from gpu_sass import (  # noqa: E402
    ROOT, TRITON, Sass, calibration_kernels, compile_plain, compile_variant, control,
    fast_path, fast_path_indices, kernels_at, memory_ops, read_sass, spills, tools_available)
from gpu_timing import (  # noqa: E402
    GPUS, ISSUE_EFFICIENCY, LATENCY, Gpu, Launched, LoopTiming, kernel_seconds,
    launched_variants, loop_timing, predict, predictions, prefetch_variants, resident_programs,
    step_elements, tile_cycles)

SIZES = {"100m": "100m", "1b": "1b"}
#: The H200 run of the kernels before #29 (docs/gpu.md): AdamW at 1B parameters,
#: fraction of the achievable bandwidth measured, without the non-finite check
H200_MEASURED_1B = {"fp32": 0.80, "bf16": 0.57, "light": 0.54, "plus": 0.52}


# ---------------------------------------------------------------------------------------
# the variants
# ---------------------------------------------------------------------------------------


def _hyper(rule) -> dict:
    """The hyperparameters whose flags a default run compiles: AdamW and Lion with weight
    decay (0.01), SGD with momentum 0.9."""
    return {"adamw": {"decays": True}, "lion": {"decays": True},
            "sgd": {"decays": False, "momentum": True}}[rule.name]


def variants(default_only: bool = False, rules: tuple[str, ...] | None = None,
             strategies: tuple[str, ...] | None = None) -> list[dict]:
    """Every (rule, strategy, launch) the launcher compiles for a model's step: the default
    configuration (``default``: verdict on the device, counters there) and ``ignore``;
    only ``rules`` and ``strategies`` where given."""
    out = []
    for rule_name in layout.RULE_CODES:
        rule = RULES[rule_name]
        if rules is not None and rule_name not in rules:
            continue
        for name in collage.STRATEGIES:
            strategy = get_strategy(name)
            if strategy.native_code not in layout.LANDINGS:
                continue
            if strategies is not None and name not in strategies:
                continue
            dtype = strategy.weight_dtypes[0]
            configurations = {"default": {"capturable": True, "skippable": True},
                              "ignore": {}}
            for configuration, extra in configurations.items():
                if default_only and configuration != "default":
                    continue
                flags = launches.variant_flags(rule, strategy, dtype, **_hyper(rule), **extra)
                for variant, masked in (("whole", False), ("tail", True)):
                    out.append({"rule": rule_name, "strategy": name,
                                "configuration": configuration, "variant": variant,
                                "flags": {**flags, **_loop_flags(masked)},
                                "bytes_per_element": int(strategy_bytes(strategy,
                                                                        rule).total),
                                "read_bytes": _read_bytes(strategy, rule, dtype),
                                "grad_bytes": dtype.itemsize})
    return out


def _read_bytes(strategy, rule, dtype: torch.dtype) -> int:
    """Bytes a step reads per element: the gradient and every component it reads."""
    return dtype.itemsize + sum(c.bytes for c in strategy.components(rule, dtype) if c.read)


def _loop_flags(masked: bool) -> dict:
    """The launch flags a row compiles. ``whole``: the kernel as a bucket with whole blocks
    and tails launches it (GPT-2's buckets: both loops in one launch), read on its first
    loop, the whole blocks'; its registers are the launch's. ``tail``: the tails' loop
    compiled alone (:func:`fast_path` reads a kernel's first loop). ``MASKED``: the same
    variants of kernels from before whole blocks and tails shared a launch
    (``--revision``)."""
    return {**launches.launch_flags(not masked, True, True, False), "MASKED": masked}


# ---------------------------------------------------------------------------------------
# the rows: each variant compiled, read and timed
# ---------------------------------------------------------------------------------------


@dataclass
class Row:
    arch: int
    rule: str
    strategy: str
    configuration: str
    variant: str
    registers: int
    spills: int
    instructions_per_element: float
    sass_memory_ops: dict
    bytes_per_element: int
    overlapped: bool
    # the latency model (``tile_cycles``), on the kernel as launched at 1B parameters
    launched_variant: str  # what the launch compiles at 1B and at 100M
    overlap_window: int  # instructions between the tile's data loads and their first wait
    instructions_per_tile: int  # a warp's, on the fast path
    bytes_in_flight_per_sm: int  # data bytes a thread has issued at that wait x residents
    little_bytes_per_sm: int  # what Little's law asks: bandwidth per SM x DRAM latency
    resident_programs: int
    bound: str  # "throughput" or "latency": which side of ``tile_cycles`` sets the time
    at_100m: dict  # the same figures for the 100M launch's variant
    predicted_1b: float  # step and check kernels; host hidden (the device is slower)
    predicted_1b_host_added: float
    predicted_100m: float  # host added (as before): = predicted_100m_host_added
    predicted_100m_host_added: float
    predicted_100m_host_hidden: float
    host_seconds: float  # the host's time per step (this machine's, launches stubbed)
    # the earlier roofline (``predict``): issue at the peak rate, memory at the
    # achievable bandwidth, added (no overlap) or the larger (full overlap)
    roofline_1b_overlap: float
    roofline_1b_no_overlap: float
    roofline_100m_host_hidden: float


def _check_kernels(module: ModuleType, arch: int, persistent: bool
                   ) -> dict[torch.dtype, dict[str, Launched]]:
    """The default check's launches (``kernels.nonfinite_check``) per gradient dtype;
    none before it existed."""
    function = getattr(module, "nonfinite_check", None)
    if function is None or not persistent:
        return {}
    return {dtype: launched_variants(function, {"W_KIND": layout.KINDS[dtype],
                                                **_loop_flags(False)}, arch, "whole", True)
            for dtype in (torch.bfloat16, torch.float32)}


def _row(gpu: Gpu, spec: dict, sass: Sass, launched: dict[str, Launched], result: dict,
         host_s: float, looped: bool, check_bytes: float) -> Row:
    opcodes = fast_path(sass)
    one, hundred = result["1b"]["figures"], result["100m"]["figures"]
    tiles = hundred["tiles_per_iteration"]  # the check's loop: CHECK_TILES tiles
    per_element = len(opcodes) / (launches.GPU_BLOCK / (32 * launches.GPU_WARPS)) / tiles
    nbytes = spec["bytes_per_element"]
    timing = launched["1b"].timing

    def bound(figures: dict) -> str:
        return "latency" if figures["latency"] > figures["throughput"] else "throughput"

    return Row(
        gpu.arch, spec["rule"], spec["strategy"], spec["configuration"], spec["variant"],
        sass.registers, spills(sass, opcodes), round(per_element, 2),
        {k: v // tiles if v % tiles == 0 else round(v / tiles, 2)
         for k, v in memory_ops(opcodes).items()},
        nbytes, looped,
        f"1b: {launched['1b'].name}; 100m: {launched['100m'].name}", timing.window,
        timing.instructions, one["bytes_in_flight_per_sm"], one["little_bytes_per_sm"],
        one["programs"], bound(one),
        {"overlap_window": launched["100m"].timing.window,
         "instructions_per_tile": launched["100m"].timing.instructions,
         "registers": launched["100m"].sass.registers,
         "bytes_in_flight_per_sm": hundred["bytes_in_flight_per_sm"], "bound": bound(hundred)},
        round(result["1b"]["hidden"], 3), round(result["1b"]["added"], 3),
        round(result["100m"]["added"], 3), round(result["100m"]["added"], 3),
        round(result["100m"]["hidden"], 3), host_s,
        round(predict(gpu, step_elements("1b"), nbytes, per_element, looped,
                      check_bytes), 3),
        round(predict(gpu, step_elements("1b"), nbytes, per_element, False,
                      check_bytes), 3),
        round(predict(gpu, step_elements("100m"), nbytes, per_element, looped, check_bytes,
                      host_s, host_hidden=True), 3))


def model_rows(archs: list[int], revision: str | None, host: dict[str, float] | None,
               default_only: bool = False, rules: tuple[str, ...] | None = None,
               strategies: tuple[str, ...] | None = None,
               calibration: bool = True, efficiency: float = ISSUE_EFFICIENCY,
               latency: dict | None = None) -> list[Row]:
    module = kernels_at(revision)
    function = module.multi_tensor_step
    persistent = "tiles" in function.arg_names
    rows = []
    specs = variants(default_only, rules, strategies)
    for arch in archs:
        gpu = GPUS[arch]
        for spec in specs:  # every variant compiled, its SASS read in the background
            prefetch_variants(function, spec["flags"], arch, spec["variant"], persistent)
        checks = _check_kernels(module, arch, persistent)
        for spec in specs:
            launched = launched_variants(function, spec["flags"], arch, spec["variant"],
                                         persistent)
            # the row's own SASS: the launch with both loops (read on the first), or
            # the tails' loop alone (as before); the predictions: the launched variants
            both = [v for v in launched.values() if v.name == "WHOLE+TAILS"]
            sass = launched["1b"].sass if not persistent or spec["variant"] != "whole" \
                else both[0].sass if both else read_sass(compile_variant(
                    function, spec["flags"], arch))
            looped = persistent and len(fast_path(sass)) < len(sass.instructions)
            default = spec["configuration"] == "default"
            dtype = get_strategy(spec["strategy"]).weight_dtypes[0]
            check = checks.get(dtype) if default else None
            host_s = (host or {}).get("skip" if default else "ignore", 0.0)
            result = predictions(gpu, launched, check, spec["bytes_per_element"],
                                 spec["grad_bytes"], host_s, efficiency, latency,
                                 spec["read_bytes"])
            rows.append(_row(gpu, spec, sass, launched, result, host_s, looped,
                             spec["grad_bytes"] if check is not None else 0.0))
        rows += check_rows(checks, gpu, efficiency, latency)
        for name, function_, signature, nbytes in calibration_kernels() if calibration else []:
            sass = read_sass(compile_plain(function_, signature, arch))
            one = Launched("one tile a program", sass, loop_timing(sass), False)
            spec = {"rule": "-", "strategy": name, "configuration": "calibration",
                    "variant": "copy" if name == "copy" else "whole",
                    "bytes_per_element": nbytes}
            result = predictions(gpu, {"1b": one, "100m": one}, None, nbytes, 0, 0.0,
                                 efficiency, latency, nbytes / 2 if name == "copy" else 16)
            rows.append(_row(gpu, spec, sass, {"1b": one, "100m": one}, result, 0.0, False,
                             0.0))
    return rows


def check_rows(checks: dict[torch.dtype, dict[str, Launched]], gpu: Gpu,
               efficiency: float = ISSUE_EFFICIENCY, latency: dict | None = None
               ) -> list[Row]:
    """The default check's kernel (``kernels.nonfinite_check``, a planned step's: it reads
    the gradients, bf16 or float32, over the step's tiles), alone, as launched at each
    size; none for kernels from before it (``--revision``)."""
    rows = []
    for dtype, whole in checks.items():
        for variant in ("whole", "tail"):
            rows.append(_check_row(gpu, dtype, variant, whole, efficiency, latency))
    return rows


def _check_row(gpu: Gpu, dtype: torch.dtype, variant: str, whole: dict[str, Launched],
               efficiency: float, latency: dict | None) -> Row:
    label = "bf16" if dtype == torch.bfloat16 else "fp32"
    spec = {"rule": "-", "strategy": f"check of {label} gradients",
            "configuration": "default", "variant": variant,
            "bytes_per_element": dtype.itemsize}
    launched = whole
    if variant == "tail":
        launched = launched_variants(whole["1b"].function, {
            "W_KIND": layout.KINDS[dtype], **_loop_flags(True)}, gpu.arch, "tail", True)
    sass = launched["100m"].sass
    looped = len(fast_path(sass)) < len(sass.instructions)
    result = predictions(gpu, launched, None, dtype.itemsize, 0, 0.0, efficiency, latency)
    return _row(gpu, spec, sass, launched, result, 0.0, looped, 0.0)


# ---------------------------------------------------------------------------------------
# calibration: the issue term fitted to the H200 run
# ---------------------------------------------------------------------------------------


#: the kernels the H200 ran (docs/gpu.md "Results"): one tile a program
H200_REVISION = "0af2d6e"


def calibrate(arch: int = 90, revision: str = H200_REVISION,
              efficiencies: tuple[float, ...] = tuple(i / 100 for i in range(60, 101)),
              dram_latencies: tuple[int, ...] = (700, 1386, 2000, 4000, 8000, 12000, 16000)
              ) -> dict:
    """The issue term fitted to the H200 run (:data:`H200_MEASURED_1B`: AdamW at 1B
    parameters, ``nonfinite="ignore"``, the kernels of ``revision``): for each DRAM
    latency, the issue efficiency whose predictions miss the run by the least (the largest
    miss, in points), and those predictions. The run constrains the latency only from
    above (one-tile programs were throughput-bound: see ``bound``)."""
    module = kernels_at(revision)
    gpu = GPUS[arch]
    compiled = {}
    for spec in variants(rules=("adamw",), strategies=tuple(H200_MEASURED_1B)):
        if spec["configuration"] == "ignore" and spec["variant"] == "whole":
            compiled[spec["strategy"]] = (spec, read_sass(compile_variant(
                module.multi_tensor_step, spec["flags"], arch)))
    out = {"revision": revision, "measured": H200_MEASURED_1B, "fits": []}
    for dram in dram_latencies:
        latency = {**LATENCY, "dram": dram}
        timed = {name: Launched("one tile a program", sass, loop_timing(sass, latency),
                                False) for name, (spec, sass) in compiled.items()}
        best = None
        for efficiency in efficiencies:
            predicted, bounds = {}, {}
            for name, (spec, _) in compiled.items():
                result = predictions(gpu, {"1b": timed[name], "100m": timed[name]}, None,
                                     spec["bytes_per_element"], 0, 0.0, efficiency, latency,
                                     spec["read_bytes"])
                predicted[name] = round(result["1b"]["hidden"], 3)
                figures = result["1b"]["figures"]
                bounds[name] = "latency" if figures["latency"] > figures["throughput"] \
                    else "throughput"
            miss = max(abs(predicted[k] - v) for k, v in H200_MEASURED_1B.items())
            if best is None or miss < best["largest_miss"] - 1e-9:
                best = {"dram_latency": dram, "efficiency": efficiency,
                        "largest_miss": round(miss, 3), "predicted": predicted,
                        "bound": bounds}
        out["fits"].append(best)
    return out


def calibration_markdown(fit: dict) -> str:
    """:func:`calibrate`'s fits as a table: per DRAM latency, the efficiency and the
    predictions against the run."""
    names = list(fit["measured"])
    lines = [f"Calibration on the H200 run of the kernels of {fit['revision']} (AdamW, 1B, "
             "`nonfinite=\"ignore\"`): measured "
             + ", ".join(f"`{k}` {100 * v:.0f} %" for k, v in fit["measured"].items()) + ".\n",
             "| DRAM latency (clocks) | issue efficiency | "
             + " | ".join(f"`{k}`" for k in names) + " | largest miss | bound |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for row in fit["fits"]:
        lines.append(f"| {row['dram_latency']} | {row['efficiency']:.2f} | "
                     + " | ".join(f"{100 * row['predicted'][k]:.1f} %" for k in names)
                     + f" | {100 * row['largest_miss']:.1f} points | "
                     + ", ".join(sorted(set(row["bound"].values()))) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# the tables and the command line
# ---------------------------------------------------------------------------------------


def markdown(rows: list[Row], host: dict[str, float] | None) -> str:
    lines = []
    if host and "measured_on" in host:
        lines.append(
            f"Host time per step (148 tensors), measured on the {host['measured_on']}'s host "
            "(least thread time of `step()`, launches included): default "
            f"{1e3 * host['skip']:.3f} ms, `nonfinite=\"ignore\"` {1e3 * host['ignore']:.3f} "
            f"ms; torch's fused AdamW {1e3 * host['torch_fused']:.3f} ms.\n")
    elif host and "recorded_in" in host:
        lines.append(
            f"Host time per step (148 tensors) from the record `{host['recorded_in']}` "
            f"(`--host-seconds`): default {1e3 * host['skip']:.3f} ms, "
            f"`nonfinite=\"ignore\"` {1e3 * host['ignore']:.3f} ms.\n")
    elif host:
        lines.append(
            "Host time per step (148 tensors; this CPU's least thread time of 38 steps, "
            "launches stubbed and counted, each priced at "
            f"{1e6 * LAUNCH_HOST_S:.0f} us): default {1e3 * host['skip']:.3f} ms "
            f"({1e3 * host['skip_python']:.3f} ms Python and torch operations, "
            f"{host['skip_launches']} kernel launches), `nonfinite=\"ignore\"` (planned) "
            f"{1e3 * host['ignore']:.3f} ms ({1e3 * host['ignore_python']:.3f} ms, "
            f"{host['ignore_launches']} launches).\n")
    lines += ["| sm | rule | strategy | config | variant | regs | spills | instr/elem | "
              "memory ops per tile | B/elem | launched | window / loop (1B) | in flight "
              "per SM: 1B (Little asks) | bound | 1B | 1B, host added | 100M, host added "
              "| 100M, host hidden | roofline 1B: overlap, none |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ops = ", ".join(f"{k} x{v}" for k, v in r.sass_memory_ops.items())
        lines.append(f"| {r.arch} | {r.rule} | {r.strategy} | {r.configuration} | {r.variant} "
                     f"| {r.registers} | {r.spills} | {r.instructions_per_element:.1f} | {ops} "
                     f"| {r.bytes_per_element} | {r.launched_variant} "
                     f"| {r.overlap_window} / {r.instructions_per_tile} "
                     f"| {r.bytes_in_flight_per_sm / 1024:.0f} KB "
                     f"({r.little_bytes_per_sm / 1024:.0f} KB) | {r.bound} "
                     f"| {100 * r.predicted_1b:.0f} % | {100 * r.predicted_1b_host_added:.0f} % "
                     f"| {100 * r.predicted_100m_host_added:.0f} % "
                     f"| {100 * r.predicted_100m_host_hidden:.0f} % "
                     f"| {100 * r.roofline_1b_overlap:.0f} %, "
                     f"{100 * r.roofline_1b_no_overlap:.0f} % |")
    return "\n".join(lines)


def _archs(text: str) -> list[int]:
    if text == "auto":
        major, _ = torch.cuda.get_device_capability()
        return [90 if major >= 9 else 80]
    return [int(a) for a in text.split(",")]


def _host_on_gpu_or_cpu(device: str) -> dict[str, float]:
    """:func:`host_seconds_on_gpu`, or, where that fails (no such device, a step that
    raises), this CPU's :func:`host_seconds` with one warning: the model's table is what
    a lent GPU's run must bring back, with or without the host's measurement."""
    try:
        return host_seconds_on_gpu("100m", device)
    except Exception as error:  # noqa: BLE001 - any failure: the CPU's figure instead
        print(f"gpu_model: the host time on {device} could not be measured ({error!r}); "
              "using this CPU's, launches stubbed", file=sys.stderr)
        return host_seconds("100m")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90,80",
                        help="comma-separated: 90 (H100/H200), 80 (A100); auto: this GPU's "
                             "(9.x and later: 90, else 80)")
    parser.add_argument("--revision", default=None,
                        help="compile the Triton kernels as they were at this git revision")
    parser.add_argument("--json", action="store_true", help="a JSON list, one object a row")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="also write the markdown table to PATH")
    parser.add_argument("--no-host", action="store_true",
                        help="leave the host time out (with --revision: the host time is "
                             "this tree's, the same for both)")
    parser.add_argument("--host-seconds", default=None, metavar="JSON",
                        help="the host time from a file (a record's \"host\" object) "
                             "instead of measuring it")
    parser.add_argument("--host-device", default="cpu",
                        help="where the host time is measured: cpu (launches stubbed, the "
                             "default) or cuda (this GPU's host, nothing stubbed)")
    parser.add_argument("--default-only", action="store_true",
                        help="only the default configuration's variants")
    parser.add_argument("--rules", default=None, help="comma-separated (default: all)")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the issue term to the H200 run of the kernels of "
                             f"{H200_REVISION} (sm_90) and print the fit, nothing else")
    args = parser.parse_args(argv)
    if not tools_available():
        print("gpu_model: Triton's NVIDIA backend (nvdisasm, cuobjdump) is not installed",
              file=sys.stderr)
        return 2
    if args.calibrate:
        fit = calibrate()
        print(json.dumps(fit, indent=1) if args.json else calibration_markdown(fit))
        return 0
    if args.no_host:
        host = None
    elif args.host_seconds:
        host = json.loads(Path(args.host_seconds).read_text())
    elif args.host_device == "cpu":
        host = host_seconds("100m")
    else:
        host = _host_on_gpu_or_cpu(args.host_device)
    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(text.split(","))

    rows = model_rows(_archs(args.arch), args.revision, host,
                      args.default_only, names(args.rules), names(args.strategies))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, host) + "\n")
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(markdown(rows, host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
