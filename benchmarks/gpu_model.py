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

and predicts the fraction of the achievable HBM bandwidth a step reaches at 100M and 1B
parameters:

    memory  = bytes moved / achievable bandwidth        (0.9 x the datasheet's)
    compute = instructions issued / issue rate           (SMs x 4 warp-instructions a clock)
    kernel  = memory + compute        one tile per program: loads wait, then arithmetic
            = max(memory, compute)    persistent programs that fetch the next tile first
    step    = kernel + check + host   (check: the non-finite check's read of the
                                       gradients; host: the Python of a step, measured here
                                       with the kernels stubbed; at 1B it is negligible)
            = max(kernel + check, host)  "host hidden": in a loop of steps that never wait
                                       for the device (the default since issue #29), the
                                       host prepares a step while the device runs the last
    predicted fraction = bytes moved (step's and check's) / achievable bandwidth / step

The first form fits the one H200 run of the previous kernels (docs/gpu.md); the second is
the assumption the persistent kernels are built on, unconfirmed until a GPU measures it
(``benchmarks/gpu_check.sh`` prints the prediction beside the measurement).

Usage:
    python benchmarks/gpu_model.py [--arch 90,80] [--json] [--revision REV] [--no-host]

``--revision REV`` compiles the Triton kernels (``src/collage/optim/triton/kernels/``) as they were at git
revision REV (the "before" table). ``--json`` prints one object per variant.
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
from dataclasses import asdict, dataclass
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
    instruction index."""

    instructions: list[tuple[str, bool, str]]
    labels: dict[str, int]
    registers: int
    local_bytes: int


def read_sass(cubin: bytes) -> Sass:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([str(_BIN / "nvdisasm"), "-c", handle.name],
                              capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", handle.name],
                               capture_output=True, text=True, check=True).stdout
    instructions, labels = [], {}
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _INSTRUCTION.search(line)
        if match:
            instructions.append((match.group(3), bool(match.group(2)), match.group(4)))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return Sass(instructions, labels, registers, local)


def _target(operands: str) -> str | None:
    found = re.search(r"`\(([^)]+)\)", operands)
    return found.group(1) if found else None


def fast_path(sass: Sass) -> list[str]:
    """The opcodes a warp issues per tile on the fast path: the persistent loop's body
    (from a backward branch's target to the branch) or, without a loop, the kernel up to
    its last ``EXIT`` before the subroutines; minus the regions a predicated forward branch
    skips that hold a ``CALL`` (the IEEE square root's and division's slow paths, which
    the fast path jumps over)."""
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
            if end > index and any(o.startswith("CALL") for o, _, _ in ops[index + 1:end]):
                skipped.update(range(index + 1, end))
    return [ops[i][0] for i in range(start, stop) if i not in skipped]


def memory_ops(opcodes: list[str]) -> dict[str, int]:
    return dict(sorted(collections.Counter(
        o for o in opcodes if o.startswith(("LDG", "STG", "LDL", "STL"))).items()))


def spills(sass: Sass, opcodes: list[str]) -> int:
    """The kernel's local memory (bytes) and its fast path's local loads and stores: 0
    where nothing spills."""
    return sass.local_bytes + sum(o.startswith(("LDL", "STL")) for o in opcodes)


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
                                "grad_bytes": dtype.itemsize})
    return out


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
    predicted_1b: float
    predicted_100m: float
    predicted_1b_no_overlap: float
    host_seconds: float  # added to the 100M step (this machine's, launches stubbed)
    predicted_100m_host_hidden: float  # the same host time, run while the device works


def model_rows(archs: list[int], revision: str | None, host: dict[str, float] | None,
               default_only: bool = False, rules: tuple[str, ...] | None = None,
               strategies: tuple[str, ...] | None = None,
               calibration: bool = True) -> list[Row]:
    module = kernels_at(revision)
    function = module.multi_tensor_step
    rows = []
    elements_per_thread = launches.GPU_BLOCK / (32 * launches.GPU_WARPS)
    n_1b = sum(torch.Size(s).numel() for _, s in gpt_shapes("1b"))
    n_100m = sum(torch.Size(s).numel() for _, s in gpt_shapes("100m"))
    for arch in archs:
        gpu = GPUS[arch]
        for spec in variants(default_only, rules, strategies):
            sass = read_sass(compile_variant(function, spec["flags"], arch))
            opcodes = fast_path(sass)
            looped = len(opcodes) < len(sass.instructions) and "tiles" in function.arg_names
            per_element = len(opcodes) / elements_per_thread
            default = spec["configuration"] == "default"
            check = spec["grad_bytes"] if default else 0.0
            host_s = (host or {}).get("skip" if default else "ignore", 0.0)
            nbytes = spec["bytes_per_element"]
            rows.append(Row(
                arch, spec["rule"], spec["strategy"], spec["configuration"], spec["variant"],
                sass.registers, spills(sass, opcodes), round(per_element, 2), memory_ops(opcodes), nbytes, looped,
                round(predict(gpu, n_1b, nbytes, per_element, looped, check), 3),
                round(predict(gpu, n_100m, nbytes, per_element, looped, check, host_s), 3),
                round(predict(gpu, n_1b, nbytes, per_element, False, check), 3), host_s,
                round(predict(gpu, n_100m, nbytes, per_element, looped, check, host_s,
                              host_hidden=True), 3)))
        rows += check_rows(module, gpu, n_1b, n_100m)
        for name, function_, signature, nbytes in calibration_kernels() if calibration else []:
            sass = read_sass(_compile_plain(function_, signature, arch))
            opcodes = fast_path(sass)
            per_element = len(opcodes) / elements_per_thread
            rows.append(Row(arch, "-", name, "calibration", "copy" if name == "copy"
                            else "whole", sass.registers, spills(sass, opcodes),
                            round(per_element, 2), memory_ops(opcodes), nbytes, False,
                            round(predict(gpu, n_1b, nbytes, per_element, False), 3),
                            round(predict(gpu, n_100m, nbytes, per_element, False), 3),
                            round(predict(gpu, n_1b, nbytes, per_element, False), 3), 0.0,
                            round(predict(gpu, n_100m, nbytes, per_element, False), 3)))
    return rows


def check_rows(module: ModuleType, gpu: Gpu, n_1b: int, n_100m: int) -> list[Row]:
    """The default check's kernel (``kernels.nonfinite_check``, a planned step's: it reads
    the gradients, bf16 or float32, over the step's tiles), alone; none for kernels from
    before it (``--revision``)."""
    function = getattr(module, "nonfinite_check", None)
    if function is None:
        return []
    rows = []
    elements_per_thread = launches.GPU_BLOCK / (32 * launches.GPU_WARPS)
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for variant, masked in (("whole", False), ("tail", True)):
            flags = {"W_KIND": layout.KINDS[dtype], **_loop_flags(masked)}
            sass = read_sass(compile_variant(function, flags, gpu.arch))
            opcodes = fast_path(sass)
            looped = len(opcodes) < len(sass.instructions)
            per_element = len(opcodes) / elements_per_thread
            nbytes = dtype.itemsize

            def fraction(n: int, overlapped: bool = looped) -> float:
                return round(predict(gpu, n, nbytes, per_element, overlapped), 3)

            rows.append(Row(gpu.arch, "-", f"check of {label} gradients", "default", variant,
                            sass.registers, spills(sass, opcodes), round(per_element, 2), memory_ops(opcodes), nbytes, looped,
                            fraction(n_1b), fraction(n_100m), fraction(n_1b, False), 0.0,
                            fraction(n_100m)))
    return rows


def markdown(rows: list[Row], host: dict[str, float] | None) -> str:
    lines = []
    if host and "measured_on" in host:
        lines.append(
            f"Host time per step (148 tensors), measured on the {host['measured_on']}'s host "
            "(least thread time of `step()`, launches included): default "
            f"{1e3 * host['skip']:.3f} ms, `nonfinite=\"ignore\"` {1e3 * host['ignore']:.3f} "
            f"ms; torch's fused AdamW {1e3 * host['torch_fused']:.3f} ms.\n")
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
              "memory ops per tile | B/elem | overlap | 1B | 100M | 100M, host hidden "
              "| 1B, no overlap |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ops = ", ".join(f"{k} x{v}" for k, v in r.sass_memory_ops.items())
        lines.append(f"| {r.arch} | {r.rule} | {r.strategy} | {r.configuration} | {r.variant} "
                     f"| {r.registers} | {r.spills} | {r.instructions_per_element:.1f} | {ops} "
                     f"| {r.bytes_per_element} | {'yes' if r.overlapped else 'no'} "
                     f"| {100 * r.predicted_1b:.0f} % | {100 * r.predicted_100m:.0f} % "
                     f"| {100 * r.predicted_100m_host_hidden:.0f} % "
                     f"| {100 * r.predicted_1b_no_overlap:.0f} % |")
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
    parser.add_argument("--no-host", action="store_true", help="leave the host time out")
    parser.add_argument("--host-device", default="cpu",
                        help="where the host time is measured: cpu (launches stubbed, the "
                             "default) or cuda (this GPU's host, nothing stubbed)")
    parser.add_argument("--default-only", action="store_true",
                        help="only the default configuration's variants")
    parser.add_argument("--rules", default=None, help="comma-separated (default: all)")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    if not tools_available():
        print("gpu_model: Triton's NVIDIA backend (nvdisasm, cuobjdump) is not installed",
              file=sys.stderr)
        return 2
    if args.no_host or args.revision:
        host = None
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
