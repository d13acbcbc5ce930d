"""Native CPU kernels: AdamW under every 16-bit strategy, hand-written C called through ctypes.

On CPU the fused path runs these instead of inductor's generated C++ where they cover a
group (:func:`covers`): rule AdamW; strategies ``fp32``, ``mixed``, ``bf16``, ``kahan``,
``stochastic``, ``light``, ``plus``, ``split``; bf16 weights (float32 for ``fp32``);
gradients bf16 or float32; contiguous local tensors. ``plus8``, fp16 weights, SGD and Lion
keep the inductor kernels.

**Semantics.** The float32-register kernel of the foreach path (``rules.AdamW.fast``,
``kernels._land``, ``kernels._store_states``) operation for operation, each correctly
rounded, with torch's roundings (``lerp_`` and ``addcmul_`` are fused multiply-adds on CPU;
bf16 stores round to nearest even, NaN -> 0xFFFF) and one deliberate difference: the square
root is correctly rounded, where torch's vectorised CPU ``sqrt`` is not for every input (then
the update differs by one float32 unit). Given a correctly rounded square root the results
are **bitwise identical to the foreach path** for every covered strategy
(``tests/optim/test_native.py``). ``stochastic`` draws its uniforms in
the kernel with the inductor fused path's counter-based hash (``fused.counter_uniform``,
keyed by ``fused.stochastic_seeds``), so it equals the inductor fused path bit for bit.

**Build.** ``native_adamw.c`` (shipped with the package) is compiled on first use with the
system C compiler (``$CC``, else ``cc``, ``gcc``, ``clang``), ``-O3 -march=native
-ffp-contract=off -fopenmp -shared -fPIC``, without torch headers (about 11 s for the AVX-512
build on a 2-vCPU Zen 4 guest, 2 s for the portable one: the measured variants double the
code), into
``$COLLAGE_CACHE_DIR/native/`` (default ``~/.cache/collage/native/``; ``$XDG_CACHE_HOME``
is honoured). The file name is a hash of the source, the compiler's version, the flags and
the machine (architecture and CPU flags), so a new compiler or CPU builds a new library and
a cluster's shared home never loads another machine's code. The library is written to a
temporary name and renamed (concurrent processes never load a partial file). The C file
selects AVX-512 intrinsics where the target has them (``__AVX512F__``, BW, VL) and a
portable scalar loop otherwise, so it builds on any machine; if ``-fopenmp`` or
``-march=native`` is refused (or the OpenMP build does not load) the build retries without.

**Fallback.** No compiler, a failed build or ``COLLAGE_NATIVE=0``: :func:`available` is
False and the fused path compiles inductor kernels as before (which themselves fall back to
foreach with one warning); a failed build warns once. ``fused=None`` on CPU selects the
fused path only where these kernels are available and cover the group.

**Batching and threads.** One C call per (group, step value, gradient dtype): a table of
pointers and lengths, no concatenation, no per-tensor kernel launch; a group's later steps
reuse its table after cheap checks (``native_plan.NativePlan``). With
``torch.get_num_threads() > 1`` the elements are split into that many ranges (at least
65,536 elements each, cut on multiples of 64 elements of a tensor). An OpenMP build splits
them in C with ``#pragma omp parallel``: loaded after torch, whose GNU OpenMP runtime has
the same soname, the library shares torch's runtime (``info()["openmp"] == "torch"``), so
the optimizer step runs on torch's own threads, still spinning from the backward pass,
instead of a second pool competing with them for the cores. Without OpenMP (and for
measured steps) the ranges run from a Python thread pool (ctypes releases the GIL). Each
element's draw depends only on its index in the whole tensor, so no split changes a
result.

**Measured steps** (``track_updates``): :func:`adamw` with ``sums`` runs
``collage_adamw_measured``, the same per-element step code (the weights and states are bit
for bit those of the unmeasured call) that also reduces each tensor's 11 lost-update sums
(``collage.metrics.FIELDS``) from the values in registers, with the semantics of
``tracked.py``'s CPU kernel: the intended update in float32, the changes with an exact zero
test, products summed in float32 with at most 256 terms per partial sum (one per vector
lane on AVX-512, 256 consecutive elements in the portable build) and those partial sums
in float64; counts exact. A pair's change (kahan, light, plus) is
``fl(fl(hi' - hi) + fl(lo' - lo))``: tracked's TwoSum value wherever both differences are
exact, and an exact zero test for every pair the optimizer produces (the proof is at
``pair_change`` in the C file). The sums land in a float64 host array: no device
synchronisation. A tensor split between threads gets one sum vector per range, added in
float64 (partial sums regroup, within the same bound; counts are unchanged).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import torch

__all__ = ["available", "backend", "covers", "adamw", "any_nonfinite", "STRATEGY_CODES",
           "library_path"]

SOURCE = Path(__file__).with_name("native_adamw.c")
ABI = 5
STRATEGY_CODES = {"fp32": 0, "mixed": 1, "bf16": 2, "kahan": 3, "stochastic": 4, "light": 5,
                  "plus": 6, "split": 7}
# flags of collage_adamw (native_adamw.c)
_LERP_SMALL, _DECAY, _SCALED, _MAXIMIZE, _GRAD_FP32 = 1, 2, 4, 8, 16
# in order of preference: OpenMP (torch's own runtime once loaded), without, portable
_FLAGS = (("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"),
          ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"),
          ("-O3", "-ffp-contract=off", "-shared", "-fPIC"))
# a thread gets at least this many elements (below, the pool's overhead dominates)
_MIN_CHUNK = 1 << 16
# int64 columns of a table row (native_adamw.c T_COLS): elements, weight, gradient, exp_avg,
# exp_avg_sq, exp_avg_sq_lo, extra, first index, key0, key1 (see table_row)
TABLE_COLUMNS = 10
COLUMN_GRAD, COLUMN_KEY0, COLUMN_KEY1 = 2, 8, 9
# the lost-update sums of one tensor (len(collage.metrics.FIELDS); native_adamw.c M_COUNT)
_FIELDS = 11

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_info: dict = {}
_pool: ThreadPoolExecutor | None = None


# ---------------------------------------------------------------------------------------
# build and load
# ---------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    root = os.environ.get("COLLAGE_CACHE_DIR")
    if root:
        return Path(root) / "native"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "collage" / "native"


def _compiler() -> list[str] | None:
    """The C compiler command: ``$CC`` (may hold arguments), else cc, gcc, clang."""
    cc = os.environ.get("CC")
    if cc:
        words = shlex.split(cc)
        return words if words and shutil.which(words[0]) else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _machine() -> str:
    """Architecture and CPU flags: what ``-march=native`` compiles for."""
    words = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "Features", "model name")):
                    words.append(line.strip())
                if line.strip() == "":
                    break  # the first processor describes them all
    except OSError:
        pass
    return "\n".join(words)


def _build(cc: list[str], flag_sets=_FLAGS) -> tuple[Path, bool]:
    """(path of the library, whether it was compiled now) with the first of ``flag_sets``
    that compiles; raises RuntimeError when none does."""
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{cc[0]} --version failed: {error}") from None
    source = SOURCE.read_bytes()
    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: a per-user directory under the temporary one
        cache = Path(tempfile.gettempdir()) / f"collage-native-{os.getuid()}"
        cache.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                         _machine().encode()])).hexdigest()[:20]
        target = cache / f"native_adamw-{key}.so"
        if target.exists():
            return target, False
        fd, temporary = tempfile.mkstemp(prefix=".native_adamw-", suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run([*cc, *flags, "-o", temporary, str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.replace(temporary, target)
                return target, True
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-500:]}")
        except (OSError, subprocess.SubprocessError) as error:
            errors.append(f"{' '.join(flags)}: {error}")
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    raise RuntimeError("compilation failed: " + " | ".join(errors))


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("COLLAGE_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
            _info.update(reason="disabled by COLLAGE_NATIVE=0")
            return None
        try:
            cc = _compiler()
            if cc is None:
                tried = "$CC=" + os.environ["CC"] if os.environ.get("CC") else "cc, gcc, clang"
                raise RuntimeError(f"no C compiler found ({tried})")
            path, compiled, lib = _build_and_open(cc)
        except Exception as error:  # never fatal: the inductor/foreach paths remain
            _info.update(reason=str(error))
            warnings.warn(f"collage: native CPU kernels unavailable ({error}); the CPU fused "
                          "path uses inductor kernels, the default path stays foreach "
                          "(set COLLAGE_NATIVE=0 to silence)", RuntimeWarning, stacklevel=4)
            return None
        isa = "avx512" if lib.collage_native_isa() else "portable"
        _info.update(path=str(path), compiled=compiled, isa=isa, compiler=cc, reason=None,
                     openmp=_openmp_runtime(lib))
        _lib = lib
        return lib


def _build_and_open(cc: list[str]) -> tuple[Path, bool, ctypes.CDLL]:
    """Build (or find) and load the first flag set of ``_FLAGS`` that compiles and loads
    (an OpenMP build whose runtime cannot be loaded falls through to the next)."""
    errors = []
    for flags in _FLAGS:
        try:
            path, compiled = _build(cc, (flags,))
            return path, compiled, _open(path)
        except (RuntimeError, OSError) as error:
            errors.append(str(error))
    raise RuntimeError(" | ".join(errors))


def _openmp_runtime(lib: ctypes.CDLL) -> str | None:
    """None without OpenMP; ``"torch"`` where torch runs on OpenMP and one GNU OpenMP
    runtime is loaded in the process (torch's, which the library then shares);
    ``"separate"`` otherwise."""
    if not lib.collage_native_openmp():
        return None
    try:
        with open("/proc/self/maps") as handle:
            paths = {line.split()[-1] for line in handle if "libgomp" in line}
    except OSError:
        return "separate"
    torch_omp = "OpenMP" in torch.__config__.parallel_info()
    return "torch" if torch_omp and len(paths) == 1 else "separate"


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.collage_native_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.collage_native_abi()}, expected {ABI}")
    lib.collage_adamw.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.collage_adamw.restype = ctypes.c_int
    lib.collage_adamw_threads.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.collage_adamw_threads.restype = ctypes.c_int
    lib.collage_nonfinite.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int]
    lib.collage_nonfinite.restype = ctypes.c_int
    lib.collage_adamw_measured.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.collage_adamw_measured.restype = ctypes.c_int
    lib.collage_advance_steps.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float]
    lib.collage_advance_steps.restype = ctypes.c_int
    lib.collage_stochastic_round.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int]
    lib.collage_stochastic_round.restype = ctypes.c_int
    lib.collage_stochastic_keys.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64]
    lib.collage_stochastic_keys.restype = None
    return lib


def available() -> bool:
    """Whether the native kernels are usable in this process (builds them on first call)."""
    return _load() is not None


def backend() -> str | None:
    """``"avx512"`` or ``"portable"`` (the C build's instruction set), None if unavailable."""
    return _info.get("isa") if available() else None


def library_path() -> str | None:
    """The loaded shared library, or None."""
    return _info.get("path") if available() else None


def info() -> dict:
    """What the loader did: path, compiled (now, vs. found in the cache), isa, compiler, or
    the reason it is unavailable."""
    available()
    return dict(_info)


def _reset() -> None:
    """Forget the loaded library (tests: a new environment, a new cache directory)."""
    global _lib, _tried
    with _lock:
        _lib, _tried = None, False
        _info.clear()


# ---------------------------------------------------------------------------------------
# coverage
# ---------------------------------------------------------------------------------------


def covers(rule, strategy, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Whether the native kernels can step these (local) tensors: AdamW, a covered
    strategy, CPU, bf16 weights (float32 for fp32), bf16 or float32 gradients. Builds the
    library on first call; False when it is unavailable."""
    if rule.name != "adamw" or strategy.name not in STRATEGY_CODES:
        return False
    weight = torch.float32 if strategy.name == "fp32" else torch.bfloat16
    for param, grad in zip(params, grads):
        if (param.device.type != "cpu" or grad.device.type != "cpu" or param.dtype != weight
                or grad.dtype not in (torch.bfloat16, torch.float32)):
            return False
    return available()


# ---------------------------------------------------------------------------------------
# one call
# ---------------------------------------------------------------------------------------

_EXTRA = {"mixed": "master", "kahan": "compensation", "light": "weight_lo",
          "plus": "weight_lo", "split": "weight_low_bits"}


def _layout(strategy: str) -> tuple:
    """(state key or None, dtype or None) of the table's state columns: exp_avg,
    exp_avg_sq, exp_avg_sq_lo, extra."""
    wide = torch.float32 if strategy in ("fp32", "mixed") else torch.bfloat16
    pair = strategy in ("plus", "split")
    extra = _EXTRA.get(strategy)
    extra_dtype = {"master": torch.float32, "weight_low_bits": torch.int16}.get(
        extra, torch.bfloat16)
    return (("exp_avg", wide), ("exp_avg_sq", wide),
            ("exp_avg_sq_lo", torch.bfloat16) if pair else (None, None),
            (extra, extra_dtype) if extra else (None, None))


_LAYOUTS = {name: _layout(name) for name in STRATEGY_CODES}


def row_tensors(strategy: str, param: torch.Tensor, grad: torch.Tensor, state: Mapping,
                checked: bool = False) -> tuple | None:
    """(param, grad, exp_avg, exp_avg_sq, exp_avg_sq_lo, extra) of one tensor, each of the
    dtype the kernel expects and ``param``'s size, contiguous on the CPU (``checked``: the
    caller has verified contiguity and device); None otherwise."""
    n = param.numel()
    tensors = [param, grad]
    for key, dtype in _LAYOUTS[strategy]:
        if key is None:
            tensors.append(None)
            continue
        t = state.get(key)
        if t is None or t.dtype != dtype or t.numel() != n:
            return None
        tensors.append(t)
    if grad.numel() != n:
        return None
    if not checked and not all(t is None or (t.is_contiguous() and t.device.type == "cpu")
                               for t in tensors):
        return None
    return tuple(tensors)


def adamw(strategy: str, coeffs: Mapping[str, float], rows: Sequence[tuple], *,
          scale: float | None = None, maximize: bool = False, threads: int | None = None,
          sums: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> None:
    """Step tensors of one strategy with one set of AdamW coefficients.

    ``rows``: ``(tensors, first_index, key0, key1)`` with ``tensors`` from
    :func:`row_tensors` (all gradients of one dtype), ``first_index`` the index of the first
    element in the whole tensor and ``key0``, ``key1`` the int32 key words of
    ``fused.stochastic_seeds`` (stochastic; else 0). ``coeffs``: ``rules.AdamW
    .coefficients`` (float64, rounded to float32 here as torch rounds a Python number).
    ``scale``: the GradScaler scale (float32 value) or None. ``threads``: default
    ``torch.get_num_threads()``. ``sums``: a contiguous CPU float64 tensor of shape
    ``(len(rows), len(collage.metrics.FIELDS))``: measure the step, each row's lost-update
    sums are written there (overwritten). ``lib``: another build of the library (tests).
    """
    lib = lib or _load()
    if lib is None:
        raise RuntimeError("native kernels are unavailable: " + str(_info.get("reason")))
    if sums is not None and (sums.dtype != torch.float64 or sums.device.type != "cpu"
                             or not sums.is_contiguous()
                             or tuple(sums.shape) != (len(rows), _FIELDS)):
        raise ValueError(f"sums must be a contiguous CPU float64 tensor of shape "
                         f"({len(rows)}, {_FIELDS}), got {sums.dtype} {tuple(sums.shape)}")
    if not rows:
        return
    grad_dtype = rows[0][0][1].dtype
    flags, h = arguments(coeffs, scale, maximize, grad_dtype == torch.float32)
    table = []
    for tensors, first, key0, key1 in rows:
        if tensors[1].dtype != grad_dtype:
            raise ValueError("one call steps gradients of one dtype")
        table.append(table_row(tensors, first, key0, key1))
    code = STRATEGY_CODES[strategy]
    threads = torch.get_num_threads() if threads is None else threads
    if sums is None and lib.collage_native_openmp():  # the C code splits the work itself
        call_threads(lib, code, flags, len(table), array("q", chain.from_iterable(table)),
                     h, threads)
        return
    total = sum(r[0] for r in table)
    parts = max(1, min(threads, total // _MIN_CHUNK))
    if parts == 1:
        _call(lib, code, flags, table, h, None if sums is None else sums.data_ptr())
        return
    sizes = [tuple(0 if t is None else t.element_size() for t in row[0]) for row in rows]
    chunks = _split(table, sizes, parts)
    # measured: one sum vector per piece, added into its tensor's row afterwards
    pieces = [None if sums is None else array("d", bytes(8 * _FIELDS * len(c)))
              for c, _ in chunks]
    pool = _executor(len(chunks) - 1)
    futures = [pool.submit(_call, lib, code, flags, chunk, h,
                           None if out is None else out.buffer_info()[0])
               for (chunk, _), out in zip(chunks[1:], pieces[1:])]
    _call(lib, code, flags, chunks[0][0], h,
          None if pieces[0] is None else pieces[0].buffer_info()[0])
    for future in futures:
        future.result()
    if sums is not None:
        owners = torch.tensor([o for _, chunk_owners in chunks for o in chunk_owners])
        values = torch.cat([torch.frombuffer(out, dtype=torch.float64) for out in pieces])
        sums.zero_().index_add_(0, owners, values.view(-1, _FIELDS))


def table_row(tensors: tuple, first: int, key0: int, key1: int) -> list[int]:
    """One row of a call's table, the T_* columns of the C file: ``tensors`` from
    :func:`row_tensors`, then the stochastic draws' first index and keys."""
    w, g, m, v, vlo, x = tensors
    return [w.numel(), w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
            0 if vlo is None else vlo.data_ptr(), 0 if x is None else x.data_ptr(),
            first, key0, key1]


def arguments(coeffs: Mapping[str, float], scale: float | None, maximize: bool,
              grad_fp32: bool) -> tuple[int, array]:
    """(flags, hyperparameters) of a C call: ``coeffs`` as in :func:`adamw`, each
    hyperparameter rounded to float32 as torch rounds a Python number."""
    decay = float(coeffs["decay"])
    lerp = float(coeffs["one_minus_beta1"])
    # torch's lerp picks its formula on the float32 weight
    flags = ((_LERP_SMALL if abs(ctypes.c_float(lerp).value) < 0.5 else 0)
             | (_DECAY if decay != 1.0 else 0) | (_SCALED if scale is not None else 0)
             | (_MAXIMIZE if maximize else 0) | (_GRAD_FP32 if grad_fp32 else 0))
    h = array("f", [lerp, coeffs["beta2"], coeffs["one_minus_beta2"],
                    coeffs["bias_correction2_sqrt"], coeffs["eps"], -coeffs["step_size"],
                    decay, coeffs["lr_wd"], 1.0 if scale is None else scale])
    return flags, h


def call_threads(lib, code: int, flags: int, count: int, flat: array, h: array,
                 threads: int) -> None:
    """One unmeasured call of an OpenMP build: ``count`` rows of ``TABLE_COLUMNS`` int64 in
    ``flat``, split between ``threads`` threads in C."""
    status = lib.collage_adamw_threads(code, flags, count, flat.buffer_info()[0],
                                       h.buffer_info()[0], threads)
    if status != 0:  # pragma: no cover - codes come from STRATEGY_CODES
        raise RuntimeError(f"collage_adamw_threads returned {status}")


def advance_steps(lib, steps: array, expected: float) -> bool:
    """Add 1 to the float32 step counters at the addresses ``steps`` if every one holds
    ``expected`` (True); else change nothing (False)."""
    return lib.collage_advance_steps(len(steps), steps.buffer_info()[0], expected) == 0


def loaded() -> ctypes.CDLL | None:
    """The library if an earlier call loaded it, else None (never builds)."""
    return _lib


def any_nonfinite(tensors: Sequence[torch.Tensor], threads: int | None = None,
                  lib: ctypes.CDLL | None = None) -> bool | None:
    """Whether any element of ``tensors`` is inf or nan, read once at memory speed on
    ``threads`` threads (default ``torch.get_num_threads()``); None where the library is not
    loaded or a tensor is not a contiguous CPU bf16/float32 tensor (the caller then checks
    with torch). The same verdict as ``not torch.isfinite(t).all()`` for each tensor."""
    lib = lib or _lib
    if lib is None:
        return None
    tables: dict[bool, list[int]] = {}
    for t in tensors:
        if (t.device.type != "cpu" or t.dtype not in (torch.bfloat16, torch.float32)
                or not t.is_contiguous()):
            return None
        if t.numel():
            tables.setdefault(t.dtype == torch.float32, []).extend((t.data_ptr(), t.numel()))
    threads = torch.get_num_threads() if threads is None else threads
    for wide, pairs in tables.items():
        flat = array("q", pairs)
        if lib.collage_nonfinite(int(wide), len(pairs) // 2, flat.buffer_info()[0], threads):
            return True
    return False


def _call(lib, code: int, flags: int, table: list[list[int]], h: array,
          sums: int | None = None) -> None:
    """One C call on this thread; ``sums``: the address of ``len(table)`` float64 sum
    vectors (measured)."""
    flat = array("q", chain.from_iterable(table))
    if sums is None:
        status = lib.collage_adamw(code, flags, len(table), flat.buffer_info()[0],
                                   h.buffer_info()[0])
    else:
        status = lib.collage_adamw_measured(code, flags, len(table), flat.buffer_info()[0],
                                            h.buffer_info()[0], sums)
    if status != 0:  # pragma: no cover - codes come from STRATEGY_CODES
        raise RuntimeError(f"collage_adamw returned {status}")


def _split(table, sizes, parts: int) -> list[tuple[list[list[int]], list[int]]]:
    """The rows cut into ``parts`` runs of about equal element counts (cuts on multiples of
    64 elements: no two threads write one cache line): ``(pieces, owners)`` per run, where
    ``owners[j]`` is the index in ``table`` of the row piece ``j`` comes from."""
    total = sum(row[0] for row in table)
    target = -(-total // parts)
    chunks: list[tuple[list[list[int]], list[int]]] = [([], [])]
    room = target
    for owner, (row, size) in enumerate(zip(table, sizes)):
        start, n = 0, row[0]
        while start < n:
            take = n - start
            if take > room and len(chunks) < parts:  # cut, rounded up to 64 elements
                take = min(take, -(-room // 64) * 64)
            piece = [take] + [p + start * s if p else 0 for p, s in zip(row[1:7], size)] + \
                [row[7] + start, row[8], row[9]]
            chunks[-1][0].append(piece)
            chunks[-1][1].append(owner)
            start += take
            room -= take
            if room <= 0 and len(chunks) < parts:
                chunks.append(([], []))
                room = target
    return [c for c in chunks if c[0]]


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="collage-native")
    return _pool
