"""The timing model of ``benchmarks/gpu_model.py``: one warp run through a kernel's SASS
with its control codes (``loop_timing``), Little's law per SM (``tile_cycles``), a launch's
time (``kernel_seconds``) and a step's fraction of the achievable bandwidth
(``predictions``; the earlier roofline: ``predict``). The formulas are written out in
``gpu_model.py``'s docstring and in docs/gpu.md "The model".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collage.bench.common import gpt_shapes
from collage.optim.triton import launch as launches

# beside this file: gpu_model.py, which imports this module, puts their folder on the path
from gpu_sass import (Sass, access_bytes, compile_variant, fast_path_indices, read_sass,
                      read_sass_later, registers_in, written_registers)


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


# ---------------------------------------------------------------------------------------
# what hides latency: a warp's loop from the SASS's scoreboards, Little's law per SM
# ---------------------------------------------------------------------------------------

#: Latencies in clocks. ``dram``: a load that misses the caches under load, 700 ns at the
#: H200's 1.98 GHz (issue #44's figure, with which Little's law asks 4.32 TB/s x 700 ns /
#: 132 SMs = 23 KB in flight per SM); the H200 run does not pin it
#: (``gpu_model.calibrate``). ``cached``: a load of the launch's small tables (the tile
#: list, the table's addresses, the coefficients: read by every program, so they stay in
#: L2), an assumption (not measured); ``short``: any other variable-latency instruction
#: (constants, special registers, the multi-function unit), an assumption.
LATENCY = {"dram": 1386, "cached": 300, "short": 24}
#: Warp-instructions an SM issues per clock, as a fraction of its 4 schedulers' peak: the
#: issue term, fitted to the H200 run (``calibrate``)
ISSUE_EFFICIENCY = 0.82


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
        destination = written_registers(opcode, operands)
        sources = registers_in(operands.split(",", 1)[1] if "," in operands else "")
        depends = "SR_TID" in operands or "SR_LANEID" in operands or bool(sources & tid)
        is_data = opcode.startswith("LDG") and bool(
            registers_in(operands.split(",", 1)[1]) & tid)
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
            pending[write].append((current, access_bytes(opcode) if is_data else 0, kind))
        if read != 7:
            ready[read] = max(ready[read], clock + latency["short"])
        clock += max(stall, 1)
    cycles = clock - marks.get("start", 0.0)
    loaded = 0
    tid.clear()
    for i in list(range(start)) + (body if looped else []):
        dataflow(i)  # the registers a loop carries from one iteration to the next
    for i in body:
        loaded += access_bytes(sass.instructions[i][0]) if dataflow(i) else 0
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
# a step: its kernels as each size's launch compiles them
# ---------------------------------------------------------------------------------------


def predict(gpu: Gpu, n: float, nbytes: float, instructions: float, overlapped: bool,
            check_bytes: float = 0.0, host_s: float = 0.0, host_hidden: bool = False
            ) -> float:
    """The predicted fraction of the achievable bandwidth of a step of ``n`` elements (see
    ``gpu_model.py``'s docstring). ``host_hidden``: the host's time runs while the device works
    (``step()`` never waits for the device, so in a loop of steps the slower of the two
    sets the pace) instead of before it."""
    memory = n * nbytes / gpu.achievable
    compute = n * instructions / gpu.thread_instructions_per_s
    kernel = max(memory, compute) if overlapped else memory + compute
    device = kernel + n * check_bytes / gpu.achievable
    step = max(device, host_s) if host_hidden else device + host_s
    return n * (nbytes + check_bytes) / gpu.achievable / step


def step_elements(size: str) -> int:
    """The elements of ``size``'s step (GPT-style shapes, ``bench.common.gpt_shapes``)."""
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


def launch_plan(flags: dict, variant: str, persistent: bool
                ) -> dict[str, tuple[str, dict, bool]]:
    """What a launch compiles for the 1B and 100M steps (``gpt_shapes``), by size: (name,
    flags, persistent). At 1B every tensor is a multiple of ``BLOCK`` (no tails:
    ``TAILS=False``), at 100M 86 of 148 are not (both loops); the ``tail`` row: a bucket of
    partial blocks only. The kernels before whole blocks and tails shared a launch
    (``--revision``): one tile a program, whole blocks unmasked, the same at both sizes."""
    if not persistent:
        one = ("one tile a program (MASKED=False)", flags, False)
        return {"1b": one, "100m": one}
    if variant == "tail":
        return {"1b": ("TAILS only", flags, True), "100m": ("TAILS only", flags, True)}
    plan = {}
    for size in ("1b", "100m"):
        tails = any(torch.Size(s).numel() % launches.GPU_BLOCK for _, s in gpt_shapes(size))
        plan[size] = ("WHOLE+TAILS" if tails else "WHOLE", {**flags, "TAILS": tails}, True)
    return plan


def prefetch_variants(function, flags: dict, arch: int, variant: str, persistent: bool
                      ) -> None:
    """Compile what :func:`launched_variants` will read and start reading its SASS in the
    background (``gpu_sass.read_sass_later``)."""
    for _, variant_flags, _ in launch_plan(flags, variant, persistent).values():
        read_sass_later(compile_variant(function, variant_flags, arch))


def launched_variants(function, flags: dict, arch: int, variant: str, persistent: bool
                      ) -> dict[str, Launched]:
    """The variants a launch compiles for the 1B and 100M steps (:func:`launch_plan`),
    read and timed; one object where both sizes launch the same variant."""
    out: dict[str, Launched] = {}
    made: dict[str, Launched] = {}
    for size, (name, variant_flags, persistent_) in launch_plan(flags, variant,
                                                                persistent).items():
        if name not in made:
            made[name] = _launched(function, variant_flags, arch, name, persistent_)
        out[size] = made[name]
    return out


def predictions(gpu: Gpu, step: dict[str, Launched], check: dict[str, Launched] | None,
                nbytes: float, grad_bytes: float, host_s: float,
                efficiency: float = ISSUE_EFFICIENCY, latency: dict | None = None,
                read_bytes: float | None = None) -> dict:
    """The fraction of the achievable bandwidth a step (its kernel and, where given, the
    check's) reaches at 1B and 100M parameters, the host's time added or hidden."""
    out = {}
    for size in ("1b", "100m"):
        n = step_elements(size)
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
