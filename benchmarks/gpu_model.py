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
import collections
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch

import collage
from collage.bench.common import gpt_shapes, strategy_bytes
from collage.optim import get_strategy
from collage.optim.rules import RULES
from collage.optim import nonfinite as nonfinite_policy
from collage.optim.triton import launch as launches
from collage.optim.triton import layout

ROOT = Path(__file__).resolve().parents[1]
TRITON = "src/collage/optim/triton"


@dataclass(frozen=True)
class Gpu:
    """What the model needs of a GPU (datasheet figures)."""

    name: str
    arch: int
    sms: int
    clock_hz: float
    bandwidth: float  # datasheet HBM bytes/s
    efficiency: float = 0.9  # achievable fraction (a plain copy's, as measured on H200)
    issue_per_clock: int = 4  # warp-instructions per SM per clock (4 schedulers)

    @property
    def achievable(self) -> float:
        return self.efficiency * self.bandwidth

    @property
    def thread_instructions_per_s(self) -> float:
        return self.sms * self.issue_per_clock * 32 * self.clock_hz


GPUS = {90: Gpu("H200", 90, 132, 1.98e9, 4.8e12), 80: Gpu("A100-80GB", 80, 108, 1.41e9,
                                                          2.039e12)}
SIZES = {"100m": "100m", "1b": "1b"}
#: The H200 run of the kernels before #29 (docs/gpu.md): AdamW at 1B parameters,
#: fraction of the achievable bandwidth measured, without the non-finite check
H200_MEASURED_1B = {"fp32": 0.80, "bf16": 0.57, "light": 0.54, "plus": 0.52}
_BIN = Path(launches.triton.__file__).parent / "backends" / "nvidia" / "bin" \
    if launches.triton is not None else None


# ---------------------------------------------------------------------------------------
# compiling a variant
# ---------------------------------------------------------------------------------------


def tools_available() -> bool:
    """Whether Triton's NVIDIA backend and its disassembler are here."""
    return _BIN is not None and (_BIN / "nvdisasm").exists() and (_BIN / "cuobjdump").exists()


def kernels_at(revision: str | None) -> ModuleType:
    """The Triton kernels compiled (not interpreted), as they are or as they were at
    ``revision``: the module ``kernels.py`` before 2026-12-06, the package ``kernels/``
    since (each beside ``layout.py``, which they import)."""
    if revision is None:
        return launches.kernel_module(False)
    folder = Path(tempfile.mkdtemp(prefix="collage-kernels-")) / "old_triton"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", revision,
                             f"{TRITON}/"], capture_output=True, text=True, check=True).stdout
    names = [line.rsplit("/", 1)[-1] for line in listed.split()]
    wanted = ["layout.py", "kernels"] if "kernels" in names else ["layout.py", "kernels.py"]
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision,
                              *(f"{TRITON}/{name}" for name in wanted)],
                             capture_output=True, check=True).stdout
    folder.mkdir()
    subprocess.run(["tar", "-x", "-C", str(folder), f"--strip-components={TRITON.count('/') + 1}"],
                   input=archive, check=True)
    (folder / "__init__.py").write_text("")
    sys.path.insert(0, str(folder.parent))
    package = folder / "kernels"
    location = package / "__init__.py" if package.is_dir() else folder / "kernels.py"
    spec = importlib.util.spec_from_file_location(
        "old_triton.kernels", location,
        submodule_search_locations=[str(package)] if package.is_dir() else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_triton.kernels"] = module
    spec.loader.exec_module(module)
    return module


def compile_variant(function, constants: dict, arch: int) -> bytes:
    """The cubin of ``function`` with ``constants`` (those it declares) for ``sm_<arch>``,
    with the launcher's options."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415 - optional backend
    from triton.compiler import ASTSource  # noqa: PLC0415

    names = function.arg_names
    declared = {k: v for k, v in constants.items() if k in names}
    signature = {name: layout.ARGUMENT_TYPES.get(name, "constexpr") for name in names}
    missing = [n for n in names if signature[n] == "constexpr" and n not in declared]
    if missing:
        raise KeyError(f"no value for the kernel's arguments {missing}: add them to "
                       "layout.ARGUMENT_TYPES (runtime) or the variant's flags (constexpr)")
    source = ASTSource(function, signature,
                       constexprs={(names.index(k),): v for k, v in declared.items()})
    compiled = launches.triton.compile(source, target=GPUTarget("cuda", arch, 32), options={
        "num_warps": launches.GPU_WARPS, "enable_fp_fusion": False})
    return compiled.asm["cubin"]


# ---------------------------------------------------------------------------------------
# reading the SASS
# ---------------------------------------------------------------------------------------

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+|\$?[\w$.]+):\s*$")


@dataclass
class Sass:
    """A kernel's instructions, in order: (opcode, predicated, operands), and labels by
    instruction index; ``controls``: each instruction's sm_70+ control code (stall cycles,
    write and read scoreboards, 7 for none, and the mask of scoreboards it waits on)."""

    instructions: list[tuple[str, bool, str]]
    labels: dict[str, int]
    registers: int
    local_bytes: int
    controls: list[tuple[int, int, int, int]] = field(default_factory=list)


_HEX = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")


def control(high: int) -> tuple[int, int, int, int]:
    """(stall, write scoreboard, read scoreboard, wait mask) of an instruction, from the
    high 64 bits of its 128-bit encoding (Volta and later: bits 105-108 the stall count,
    110-112 the scoreboard its result sets, 113-115 the one its operands' read releases, 7
    for none, 116-121 the scoreboards it waits on before it issues)."""
    bits = high >> 41
    return bits & 0xF, (bits >> 5) & 7, (bits >> 8) & 7, (bits >> 11) & 0x3F


def read_sass(cubin: bytes) -> Sass:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([str(_BIN / "nvdisasm"), "-c", "-hex", handle.name],
                              capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", handle.name],
                               capture_output=True, text=True, check=True).stdout
    instructions, labels, controls = [], {}, []
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _INSTRUCTION.search(line)
        if match:
            instructions.append((match.group(3), bool(match.group(2)), match.group(4)))
            continue
        high = _HEX.match(line)
        if high and len(controls) < len(instructions):
            controls.append(control(int(high.group(1), 16)))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return Sass(instructions, labels, registers, local, controls)


def _target(operands: str) -> str | None:
    found = re.search(r"`\(([^)]+)\)", operands)
    return found.group(1) if found else None


def fast_path(sass: Sass) -> list[str]:
    """The opcodes a warp issues per tile on the fast path: the persistent loop's body
    (from a backward branch's target to the branch) or, without a loop, the kernel up to
    its last ``EXIT`` before the subroutines; minus the regions a predicated forward branch
    skips that hold a ``CALL`` (the IEEE square root's and division's slow paths, which
    the fast path jumps over)."""
    return [sass.instructions[i][0] for i in fast_path_indices(sass)[1]]


def fast_path_indices(sass: Sass) -> tuple[int, list[int]]:
    """(where the fast path starts, its instructions' indices): :func:`fast_path`'s
    instructions, as positions in ``sass.instructions``."""
    ops = sass.instructions
    start, stop = 0, len(ops)
    for index, (opcode, _, operands) in enumerate(ops):
        target = _target(operands)
        if opcode == "BRA" and target in sass.labels and sass.labels[target] <= index:
            if sass.labels[target] < index:  # not the trailing self-loop
                start, stop = sass.labels[target], index + 1
                break
    else:
        exits = [i for i, (opcode, predicated, _) in enumerate(ops)
                 if opcode == "EXIT" and not predicated]
        stop = exits[0] + 1 if exits else len(ops)
    skipped = set()
    for index in range(start, stop):
        opcode, predicated, operands = ops[index]
        target = _target(operands)
        if opcode == "BRA" and predicated and target in sass.labels:
            end = sass.labels[target]
            if index < end <= index + _SLOW_PATH and any(
                    o.startswith("CALL") for o, _, _ in ops[index + 1:end]):
                skipped.update(range(index + 1, end))
    return start, [i for i in range(start, stop) if i not in skipped]


#: The most instructions a slow path's branch skips (a call and its arguments moved): a
#: longer skipped region holding calls is a conditional tile, on the fast path
_SLOW_PATH = 32


def memory_ops(opcodes: list[str]) -> dict[str, int]:
    return dict(sorted(collections.Counter(
        o for o in opcodes if o.startswith(("LDG", "STG", "LDL", "STL"))).items()))


def spills(sass: Sass, opcodes: list[str]) -> int:
    """The kernel's local memory (bytes) and its fast path's local loads and stores: 0
    where nothing spills."""
    return sass.local_bytes + sum(o.startswith(("LDL", "STL")) for o in opcodes)


# ---------------------------------------------------------------------------------------
# what hides latency: a warp's loop from the SASS's scoreboards, Little's law per SM
# ---------------------------------------------------------------------------------------

#: Latencies in clocks. ``dram``: a load that misses the caches under load, 700 ns at the
#: H200's 1.98 GHz (issue #44's figure, with which Little's law asks 4.32 TB/s x 700 ns /
#: 132 SMs = 23 KB in flight per SM); the H200 run does not pin it (below, "calibration").
#: ``cached``: a load of the launch's small tables (the tile list, the table's addresses,
#: the coefficients: read by every program, so they stay in L2), an assumption (not
#: measured); ``short``: any other variable-latency instruction (constants, special
#: registers, the multi-function unit), an assumption.
LATENCY = {"dram": 1386, "cached": 300, "short": 24}
#: Warp-instructions an SM issues per clock, as a fraction of its 4 schedulers' peak: the
#: issue term, fitted to the H200 run (``calibrate``)
ISSUE_EFFICIENCY = 0.82

_REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
_NO_DESTINATION = ("ST", "RED", "BRA", "EXIT", "BSSY", "BSYNC", "BAR", "CALL", "RET",
                   "NOP", "WARPSYNC", "ISETP", "FSETP", "DSETP", "PLOP3", "UISETP", "MEMBAR",
                   "ERRBAR", "CCTL", "YIELD", "BPT")


def _width(opcode: str) -> int:
    """Bytes a thread's global load or store moves."""
    for suffix, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                         (".S8", 1)):
        if suffix in opcode:
            return size
    return 4


def _registers(text: str) -> set[int]:
    out = set()
    for number, wide in _REGISTER.findall(text):
        out.update(range(int(number), int(number) + (2 if wide else 1)))
    return out


def _destination(opcode: str, operands: str) -> set[int]:
    """The general registers an instruction writes (its first operand)."""
    if opcode.startswith(_NO_DESTINATION) or opcode.startswith("U"):
        return set()
    first = operands.split(",")[0]
    match = re.match(r"\s*R(\d+)\b", first)
    if not match:
        return set()
    count = 4 if opcode.endswith(".128") else 2 if (
        ".64" in opcode or ".WIDE" in opcode) else 1
    return set(range(int(match.group(1)), int(match.group(1)) + count))


@dataclass
class LoopTiming:
    """One warp's persistent loop (or, without one, its whole kernel), read off the SASS."""

    instructions: int  # warp-instructions issued per tile on the fast path
    cycles: float  # a warp's iteration alone: issue stalls and the waits the window leaves
    window: int  # instructions a warp issues per iteration while one of its data loads is
    #              in flight (issued, not yet waited on): the work that hides their latency
    bytes_in_flight: int  # the most data bytes a thread has in flight at a wait on them
    data_bytes: int  # data bytes a thread loads per iteration (the tiles it steps)
    data_waits: int  # waits that stall on a data load's scoreboard per iteration
    cached_waits: int  # the same on a table or coefficient load's


def loop_timing(sass: Sass, latency: dict | None = None) -> LoopTiming:
    """Run one warp through the fast path (the loop three times, the third timed) with the
    control codes: each instruction issues after its stall count and after every
    scoreboard it waits on is released; a load releases its scoreboard ``latency`` clocks
    after it issues (``dram`` where its address depends on the thread's index: a tile's
    data; ``cached`` for the uniform ones: the tile list, table, coefficients). A data
    load is in flight from its issue to the first wait on its scoreboard (a wait releases
    every load on it: a coefficient or a later tile's load that shares the scoreboard is
    waited for too)."""
    latency = latency or LATENCY
    start, body = fast_path_indices(sass)
    looped = start > 0 or body[-1] + 1 < len(sass.instructions) and \
        sass.instructions[body[-1]][0] == "BRA"
    passes = 3 if looped else 1
    stream = list(range(start)) if looped else []
    stream_body = [(p, i) for p in range(passes) for i in body]
    tid: set[int] = set()
    ready = [0.0] * 7  # the clock each scoreboard is released at
    pending: list[list[tuple[int, int, int]]] = [[] for _ in range(7)]  # (pass, count, bytes)
    clock = 0.0
    window = flight = data_waits = cached_waits = 0
    marks = {}

    def dataflow(i: int) -> bool:
        opcode, predicated, operands = sass.instructions[i]
        destination = _destination(opcode, operands)
        sources = _registers(operands.split(",", 1)[1] if "," in operands else "")
        depends = "SR_TID" in operands or "SR_LANEID" in operands or bool(sources & tid)
        is_data = opcode.startswith("LDG") and bool(_registers(operands.split(",", 1)[1]
                                                              ) & tid)
        if depends:
            tid.update(destination)
        elif not predicated:
            tid.difference_update(destination)
        return is_data

    for i in stream:
        dataflow(i)
    for current, i in stream_body:
        timed = current == passes - 1
        if timed and i == body[0]:
            marks["start"] = clock
        opcode, _, operands = sass.instructions[i]
        stall, write, read, wait = sass.controls[i]
        is_data = dataflow(i)
        for board in range(6):
            if wait >> board & 1:
                kinds = {k for _, _, k in pending[board]}
                if timed and clock < ready[board]:
                    data_waits += "data" in kinds
                    cached_waits += "data" not in kinds and "cached" in kinds
                if timed and "data" in kinds:
                    flight = max(flight, sum(c for _, c, k in sum(pending, []) if k == "data"))
                clock = max(clock, ready[board])
                pending[board] = []
        if timed and any(k == "data" for _, _, k in sum(pending, [])):
            window += 1  # issued while a data load of this warp is in flight
        kind = "data" if is_data else "cached" if opcode.startswith("LDG") else "short"
        if write != 7:
            ready[write] = max(ready[write], clock + latency["dram" if is_data else kind])
            pending[write].append((current, _width(opcode) if is_data else 0, kind))
        if read != 7:
            ready[read] = max(ready[read], clock + latency["short"])
        clock += max(stall, 1)
    cycles = clock - marks.get("start", 0.0)
    loaded = 0
    tid.clear()
    for i in list(range(start)) + (body if looped else []):
        dataflow(i)  # the registers a loop carries from one iteration to the next
    for i in body:
        loaded += _width(sass.instructions[i][0]) if dataflow(i) else 0
    return LoopTiming(len(body), cycles, window, flight, loaded, data_waits, cached_waits)


def resident_programs(registers: int, per_sm_launched: float, warps: int) -> int:
    """Programs of ``warps`` warps an SM holds at once: its 65,536 registers (allocated
    per warp in 256s, so a thread's count rounded up to 8), 64 warps, 32 blocks; and no
    more than the launch gives it (``per_sm_launched``: programs per SM in the grid)."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * warps)
    return max(1, int(min(by_registers, 64 // warps, 32, per_sm_launched)))


def tile_cycles(gpu: Gpu, timing: LoopTiming, programs: int, tile_bytes: float,
                efficiency: float = ISSUE_EFFICIENCY, latency: dict | None = None
                ) -> dict:
    """Clocks an SM spends per tile (``BLOCK`` elements, one program's 4 warps, one on each
    scheduler) with ``programs`` resident, the larger of:

    * throughput: the tile's bytes at the SM's share of the achievable bandwidth, plus
      the instructions each scheduler issues for it (``instructions / efficiency``),
      less the share of those issued inside the overlap window (the data loads already
      in flight), at most the memory time: ``memory + issue - min(memory, issue x
      window / instructions)``. The H200 run of one-tile programs (no window) fits
      ``memory + issue``: the arithmetic of a tile did not hide another's traffic;
    * latency (Little's law): each resident warp needs ``timing.cycles`` per tile on its
      own (its waits included), so an SM finishes ``programs`` tiles per that time; the
      bytes those warps have in flight, ``programs x 128 x bytes_in_flight``, against the
      ``bandwidth x latency`` per SM that Little's law asks for, is reported beside it.
    """
    per_sm = gpu.achievable / gpu.sms / gpu.clock_hz  # bytes a clock
    memory = tile_bytes / per_sm
    issue = timing.instructions / efficiency
    hidden = min(memory, issue * timing.window / max(timing.instructions, 1))
    throughput = memory + issue - hidden
    latency_bound = timing.cycles / programs
    in_flight = programs * 32 * launches.GPU_WARPS * timing.bytes_in_flight
    asked = per_sm * (latency or LATENCY)["dram"]
    return {"cycles": max(throughput, latency_bound), "memory": memory,
            "throughput": throughput, "latency": latency_bound,
            "bytes_in_flight_per_sm": in_flight, "little_bytes_per_sm": round(asked)}


def kernel_seconds(gpu: Gpu, timing: LoopTiming, registers: int, n: float,
                   nbytes: float, persistent: bool, efficiency: float = ISSUE_EFFICIENCY,
                   latency: dict | None = None, tiles_per_iteration: int = 1
                   ) -> tuple[float, dict]:
    """A launch over ``n`` elements: ``n / BLOCK`` tiles spread over the SMs, each
    iteration of a program's loop ``tiles_per_iteration`` of them (:func:`tile_cycles`);
    ``persistent``: ``PROGRAMS_PER_SM`` programs an SM (the launch's grid), else one
    program a tile (as many resident as the registers allow)."""
    tiles = n / launches.GPU_BLOCK
    launched = launches.PROGRAMS_PER_SM if persistent else tiles / gpu.sms
    programs = resident_programs(registers, launched, launches.GPU_WARPS)
    per_tile = tile_cycles(gpu, timing, programs,
                           launches.GPU_BLOCK * nbytes * tiles_per_iteration, efficiency,
                           latency)
    per_tile["programs"] = programs
    per_tile["tiles_per_iteration"] = tiles_per_iteration
    return tiles / tiles_per_iteration / gpu.sms * per_tile["cycles"] / gpu.clock_hz, \
        per_tile


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
# calibration kernels: a copy and a plain float32 AdamW
# ---------------------------------------------------------------------------------------


def calibration_kernels() -> list[tuple[str, object, dict, int]]:
    """(name, jit function, signature, bytes per element): a float32 copy and a plain
    float32 AdamW with IEEE square root and division (torch's fused AdamW's arithmetic)."""
    triton, tl = launches.triton, launches.triton.language
    with launches._mode(False):  # compiled, whatever TRITON_INTERPRET says
        return _calibration_kernels(triton, tl)


def _calibration_kernels(triton, tl) -> list[tuple[str, object, dict, int]]:
    @triton.jit
    def copy(src, dst, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))

    @triton.jit
    def adamw(w, g, m, v, b1, b2, bc2, eps, step_size, decay, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        grad = tl.load(g + offs)
        mm = tl.load(m + offs) * b1 + grad * (1 - b1)
        vv = tl.load(v + offs) * b2 + grad * grad * (1 - b2)
        denom = tl.div_rn(tl.sqrt_rn(vv), bc2) + eps
        tl.store(m + offs, mm)
        tl.store(v + offs, vv)
        tl.store(w + offs, tl.load(w + offs) * decay - tl.div_rn(mm * step_size, denom))

    scalars = {n: "fp32" for n in ("b1", "b2", "bc2", "eps", "step_size", "decay")}
    return [("copy", copy, {"src": "*fp32", "dst": "*fp32", "BLOCK": "constexpr"}, 8),
            ("plain fp32 AdamW", adamw, {**{n: "*fp32" for n in "wgmv"}, **scalars,
                                         "BLOCK": "constexpr"}, 28)]


def _compile_plain(function, signature: dict, arch: int) -> bytes:
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415 - optional backend
    from triton.compiler import ASTSource  # noqa: PLC0415

    names = function.arg_names
    source = ASTSource(function, signature,
                       constexprs={(names.index("BLOCK"),): launches.GPU_BLOCK})
    return launches.triton.compile(source, target=GPUTarget("cuda", arch, 32), options={
        "num_warps": launches.GPU_WARPS, "enable_fp_fusion": False}).asm["cubin"]


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------


def predict(gpu: Gpu, n: float, nbytes: float, instructions: float, overlapped: bool,
            check_bytes: float = 0.0, host_s: float = 0.0, host_hidden: bool = False
            ) -> float:
    """The predicted fraction of the achievable bandwidth of a step of ``n`` elements (see
    the module docstring). ``host_hidden``: the host's time runs while the device works
    (``step()`` never waits for the device, so in a loop of steps the slower of the two
    sets the pace) instead of before it."""
    memory = n * nbytes / gpu.achievable
    compute = n * instructions / gpu.thread_instructions_per_s
    kernel = max(memory, compute) if overlapped else memory + compute
    device = kernel + n * check_bytes / gpu.achievable
    step = max(device, host_s) if host_hidden else device + host_s
    return n * (nbytes + check_bytes) / gpu.achievable / step


def _check_as_on_a_gpu(grads: list[torch.Tensor]) -> torch.Tensor:
    """``nonfinite.nonfinite_flag``'s GPU form (one multi-tensor max-norm), whatever the
    device: the CPU's per-tensor form is not what a GPU's host runs. (A planned default
    step does not call it: its plan's check kernels read the gradients.)"""
    extremes = torch.stack(torch._foreach_norm(grads, float("inf")))
    return (~torch.isfinite(extremes).all()).to(torch.float32)


#: The host time of one Triton kernel launch (the Python launcher: binding ~30 arguments,
#: the specialization key, the driver call): an estimate, not measured (no GPU here); the
#: stubbed launches of :func:`host_seconds` are counted and priced at it.
#: ``benchmarks/gpu_check.sh`` measures a step's host time on a GPU.
LAUNCH_HOST_S = 20e-6


def _kernel_launches(size: str) -> int:
    """The kernels one ``launch.launch`` or ``launch.check`` call runs for a bucket of
    ``size``'s tensors at their real sizes: one (whole blocks and tails share a launch)."""
    return int(any(torch.Size(shape).numel() for _, shape in gpt_shapes(size)))


def host_seconds_on_gpu(size: str, device: str = "cuda", repeats: int = 30
                        ) -> dict[str, float]:
    """:func:`host_seconds` measured on a GPU's host, nothing stubbed: ``plus`` (the default
    path there: the Triton kernels) over ``size``'s tensors at their real shapes, the
    thread CPU time of ``step()`` alone (the device synchronised before each step, so that
    a full launch queue never blocks it), least of ``repeats``; and torch's fused AdamW on
    float32 weights, the same way (``torch_fused``). Launches included (``*_launches``: 0,
    nothing to add)."""
    shapes = [shape for _, shape in gpt_shapes(size)]

    def least(opt: torch.optim.Optimizer) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.thread_time()
            opt.step()
            times.append(time.thread_time() - start)
        torch.cuda.synchronize(device)
        return min(times[2:])

    def params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        made = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
                for shape in shapes]
        for p in made:
            p.grad = torch.full_like(p, 1e-3)
        return made

    out: dict[str, float] = {}
    for policy in ("skip", "ignore"):
        python = least(collage.AdamW(params(torch.bfloat16), lr=1e-4, strategy="plus",
                                     nonfinite=policy))
        out.update({policy: python, f"{policy}_python": python, f"{policy}_launches": 0})
    out["torch_fused"] = least(torch.optim.AdamW(params(torch.float32), lr=1e-4,
                                                 fused=True))
    out["measured_on"] = torch.cuda.get_device_name(device)
    return out


def host_seconds(size: str, repeats: int = 40) -> dict[str, float]:
    """Host time of one default step (``nonfinite="skip"``: verdict on the device) and one
    planned ``nonfinite="ignore"`` step of ``plus`` over ``size``'s tensors (shapes kept,
    4 elements each, so that no data work is timed), on this machine's CPU with the Triton
    launches stubbed (counted, and priced at :data:`LAUNCH_HOST_S` each) and the per-tensor
    check in its GPU form: the Python and the small torch operations a GPU's host would run
    (each a launch there; here a CPU operation on a 0-d or small tensor, of about the same
    host cost). The least thread CPU time of ``repeats`` steps: what the step costs this
    CPU, not the other processes sharing its two cores (wall-clock medians on a busy
    machine vary by 2x). Keys: ``skip`` and ``ignore`` (Python and launches, seconds),
    ``<policy>_python`` and ``<policy>_launches`` (kernel launches per step)."""
    import os  # noqa: PLC0415 - the interpreter flag, read when the path is chosen

    saved_flag = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path (not run)
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
              for _ in gpt_shapes(size)]
    saved = launches.launch, launches.check, nonfinite_policy.nonfinite_flag
    counted, per_call = [0], _kernel_launches(size)

    def count(*args, **kwargs) -> None:
        counted[0] += per_call

    launches.launch = launches.check = count
    nonfinite_policy.nonfinite_flag = _check_as_on_a_gpu
    try:
        out = {}
        for policy in ("skip", "ignore"):
            opt = collage.AdamW(params, lr=1e-4, strategy="plus", fused="triton",
                                nonfinite=policy)
            times = []
            for _ in range(repeats):
                for p in params:
                    p.grad = torch.ones_like(p)
                counted[0] = 0
                start = time.thread_time()
                opt.step()
                times.append(time.thread_time() - start)
            out[f"{policy}_python"] = min(times[2:])
            out[f"{policy}_launches"] = counted[0]  # the last (planned) step's
            out[policy] = out[f"{policy}_python"] + counted[0] * LAUNCH_HOST_S
        return out
    finally:
        launches.launch, launches.check, nonfinite_policy.nonfinite_flag = saved
        if saved_flag is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_flag


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


#: the elements of the two sizes' steps (GPT-style shapes, ``bench.common.gpt_shapes``)
def _elements(size: str) -> int:
    return sum(torch.Size(s).numel() for _, s in gpt_shapes(size))


@dataclass
class Launched:
    """A kernel variant as one size's launch compiles it, read and timed."""

    name: str
    sass: Sass
    timing: LoopTiming
    persistent: bool
    function: object = None

    def seconds(self, gpu: Gpu, n: float, nbytes: float, read_bytes: float,
                efficiency: float, latency: dict | None) -> tuple[float, dict]:
        """Its time over ``n`` elements of ``nbytes`` each, ``read_bytes`` of them read:
        the tiles one iteration of its loop steps are the data a thread loads there over
        one tile's (the check reads ``CHECK_TILES`` tiles an iteration, the step two)."""
        per_thread = launches.GPU_BLOCK // (32 * launches.GPU_WARPS)
        tiles = max(1, round(self.timing.data_bytes / (read_bytes * per_thread)))
        return kernel_seconds(gpu, self.timing, self.sass.registers, n, nbytes,
                              self.persistent, efficiency, latency, tiles)


def _launched(function, flags: dict, arch: int, name: str, persistent: bool) -> Launched:
    sass = read_sass(compile_variant(function, flags, arch))
    return Launched(name, sass, loop_timing(sass), persistent, function)


def launched_variants(function, flags: dict, arch: int, variant: str, persistent: bool
                      ) -> dict[str, Launched]:
    """The variants a launch compiles for the 1B and 100M steps (``gpt_shapes``): at 1B
    every tensor is a multiple of ``BLOCK`` (no tails: ``TAILS=False``), at 100M 86 of
    148 are not (both loops); the ``tail`` row: a bucket of partial blocks only. The
    kernels before whole blocks and tails shared a launch (``--revision``): one tile a
    program, whole blocks unmasked, the same at both sizes."""
    if not persistent:
        one = _launched(function, flags, arch, "one tile a program (MASKED=False)", False)
        return {"1b": one, "100m": one}
    if variant == "tail":
        one = _launched(function, flags, arch, "TAILS only", True)
        return {"1b": one, "100m": one}
    tails = {size: any(torch.Size(s).numel() % launches.GPU_BLOCK for _, s in
                       gpt_shapes(size)) for size in ("1b", "100m")}
    out = {}
    for size in ("1b", "100m"):
        named = "WHOLE+TAILS" if tails[size] else "WHOLE"
        same = [v for v in out.values() if v.name == named]
        out[size] = same[0] if same else _launched(function, {**flags, "TAILS": tails[size]},
                                                   arch, named, True)
    return out


def predictions(gpu: Gpu, step: dict[str, Launched], check: dict[str, Launched] | None,
                nbytes: float, grad_bytes: float, host_s: float,
                efficiency: float = ISSUE_EFFICIENCY, latency: dict | None = None,
                read_bytes: float | None = None) -> dict:
    """The fraction of the achievable bandwidth a step (its kernel and, where given, the
    check's) reaches at 1B and 100M parameters, the host's time added or hidden."""
    out = {}
    for size in ("1b", "100m"):
        n = _elements(size)
        seconds, figures = step[size].seconds(gpu, n, nbytes, read_bytes or nbytes,
                                              efficiency, latency)
        moved = nbytes
        if check is not None:
            seconds += check[size].seconds(gpu, n, grad_bytes, grad_bytes, efficiency,
                                           latency)[0]
            moved += grad_bytes
        ideal = n * moved / gpu.achievable
        out[size] = {"added": ideal / (seconds + host_s),
                     "hidden": ideal / max(seconds, host_s), "figures": figures}
    return out


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
        round(predict(gpu, _elements("1b"), nbytes, per_element, looped, check_bytes), 3),
        round(predict(gpu, _elements("1b"), nbytes, per_element, False, check_bytes), 3),
        round(predict(gpu, _elements("100m"), nbytes, per_element, looped, check_bytes,
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
    for arch in archs:
        gpu = GPUS[arch]
        checks = _check_kernels(module, arch, persistent)
        for spec in variants(default_only, rules, strategies):
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
            sass = read_sass(_compile_plain(function_, signature, arch))
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
