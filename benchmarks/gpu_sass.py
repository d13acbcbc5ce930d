"""The Triton kernels' SASS, read without a GPU (``benchmarks/gpu_model.py``'s input).

Triton compiles a kernel for an NVIDIA target without a GPU, and its wheel ships
``nvdisasm`` and ``cuobjdump``: this module compiles a variant of the kernels (as they are,
or as they were at a git revision) for ``sm_<arch>``, disassembles it, and reads off what
the model needs: the instructions with their control codes (``read_sass``), the fast path
a warp issues per tile (``fast_path``), its global memory operations and spills, and the
registers an instruction reads and writes (``gpu_timing.loop_timing`` follows a thread's
index through them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import importlib.util
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from collage.optim.triton import launch as launches
from collage.optim.triton import layout

ROOT = Path(__file__).resolve().parents[1]
TRITON = "src/collage/optim/triton"
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


#: cubins compiled in this process, by (function, constants, arch): a variant the model
#: reads twice (prefetched, then read) compiles once, whether or not Triton's cache is on.
#: Keyed by the function itself (equal only to itself), not its id: a revision's kernels
#: replaced by another's (``kernels_at``) could free theirs and hand its id to a new one
_CUBINS: dict[tuple, bytes] = {}


def compile_variant(function, constants: dict, arch: int) -> bytes:
    """The cubin of ``function`` with ``constants`` (those it declares) for ``sm_<arch>``,
    with the launcher's options (compiled once a process)."""
    key = (function, tuple(sorted(constants.items())), arch)
    if key not in _CUBINS:
        _CUBINS[key] = _compile_variant(function, constants, arch)
    return _CUBINS[key]


def _compile_variant(function, constants: dict, arch: int) -> bytes:
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


#: the disassemblies under way (:func:`read_sass_later`), by the cubin's digest; two
#: workers: each waits on an nvdisasm process (0.4 s a variant) while this one compiles
_DISASSEMBLER = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                      thread_name_prefix="nvdisasm")
_UNDER_WAY: dict[bytes, concurrent.futures.Future] = {}


def read_sass_later(cubin: bytes) -> None:
    """Start reading ``cubin``'s SASS in the background; :func:`read_sass` returns it. The
    model's rows prefetch every variant this way, so that the disassembler runs while the
    next variant compiles (the model's time over all variants: about two thirds)."""
    key = hashlib.sha256(cubin).digest()
    if key not in _UNDER_WAY:
        _UNDER_WAY[key] = _DISASSEMBLER.submit(_read_sass, cubin)


def read_sass(cubin: bytes) -> Sass:
    """``cubin``'s instructions, labels, control codes, registers and local memory: the
    background read of :func:`read_sass_later` where one was started, else read now."""
    started = _UNDER_WAY.pop(hashlib.sha256(cubin).digest(), None)
    return started.result() if started is not None else _read_sass(cubin)


def _read_sass(cubin: bytes) -> Sass:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        # -ndf: no dataflow analysis, which only annotates; the same text (every row of
        # the gpu-model record byte for byte) in 0.37 s instead of 0.49 s a variant
        text = subprocess.run([str(_BIN / "nvdisasm"), "-c", "-hex", "-ndf", handle.name],
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
# the registers an instruction reads and writes
# ---------------------------------------------------------------------------------------

_REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
_NO_DESTINATION = ("ST", "RED", "BRA", "EXIT", "BSSY", "BSYNC", "BAR", "CALL", "RET",
                   "NOP", "WARPSYNC", "ISETP", "FSETP", "DSETP", "PLOP3", "UISETP", "MEMBAR",
                   "ERRBAR", "CCTL", "YIELD", "BPT")


def access_bytes(opcode: str) -> int:
    """Bytes a thread's global load or store moves."""
    for suffix, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                         (".S8", 1)):
        if suffix in opcode:
            return size
    return 4


def registers_in(text: str) -> set[int]:
    """The general registers ``text`` names (``R4.64``: R4 and R5)."""
    out = set()
    for number, wide in _REGISTER.findall(text):
        out.update(range(int(number), int(number) + (2 if wide else 1)))
    return out


def written_registers(opcode: str, operands: str) -> set[int]:
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


def compile_plain(function, signature: dict, arch: int) -> bytes:
    """The cubin of a calibration kernel (``BLOCK`` its only constant) for ``sm_<arch>``,
    with the launcher's options."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415 - optional backend
    from triton.compiler import ASTSource  # noqa: PLC0415

    names = function.arg_names
    source = ASTSource(function, signature,
                       constexprs={(names.index("BLOCK"),): launches.GPU_BLOCK})
    return launches.triton.compile(source, target=GPUTarget("cuda", arch, 32), options={
        "num_warps": launches.GPU_WARPS, "enable_fp_fusion": False}).asm["cubin"]
