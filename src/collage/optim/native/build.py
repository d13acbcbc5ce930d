"""Building, caching and loading the native library.

**Sources.** ``SOURCES``, shipped with the package, split by concern (``native.h`` maps
them): ``native.h`` (layout, ABI, exported functions), ``rounding.h`` (bit helpers),
``step.h`` and ``step_avx512.h`` (the per-element step, shared by the measured and
unmeasured kernels), and three translation units, ``UNITS``: ``adamw.c`` (unmeasured entry
points), ``measured.c`` (the measured one), ``support.c`` (the rest).

**Build.** The units are compiled on first use with the system C compiler (``$CC``, else
``cc``, ``gcc``, ``clang``) in one call, ``cc -O3 -march=native -ffp-contract=off -fopenmp
-shared -fPIC -o lib.so adamw.c measured.c support.c -lm``, without torch headers, into
``$COLLAGE_CACHE_DIR/native/`` (default ``~/.cache/collage/native/``; ``$XDG_CACHE_HOME``
is honoured). One call with every unit, rather than one file that includes the others:
each ``.c`` stays a translation unit that compiles on its own, and the command is the
single-file one with three names. The step is ``static inline`` code in headers, so each
entry point is compiled from the same code as when the library was one file: the generated
code is the same, instruction for instruction. The file name is a hash of every source
(units and headers: editing any of them rebuilds), the compiler's version, the flags and
the machine (architecture and CPU flags), so a new compiler or CPU builds a new library and
a cluster's shared home never loads another machine's code. The library is written to a
temporary name and renamed (concurrent processes never load a partial file).

**Trust** (``cache``, ``docs/security.md``). Native code is built in and loaded from a
directory only if no other user can write it or a directory above it, and a cached library
only if it and the record of its SHA-256 beside it are files of ours that no one else can
write and its bytes still have that digest; otherwise one warning, and a rebuild (in the
process's own ``mkdtemp`` directory where the cache itself is not private).

**Instruction sets.** The sources select AVX-512 intrinsics where the target has them
(``__AVX512F__``, BW, VL) and a portable scalar loop otherwise, so they build on any
machine; if ``-fopenmp`` or ``-march=native`` is refused (or the OpenMP build does not load)
the build retries without.

**Fallback.** No compiler, a failed build or ``COLLAGE_NATIVE=0``: :func:`available` is
False and the CPU paths use inductor's kernels (``fused=True``) or the eager ones; a failed
build warns once.

**OpenMP.** Loaded after torch, whose GNU OpenMP runtime has the same soname, an OpenMP
build shares torch's runtime (``info()["openmp"] == "torch"``), so the optimizer step runs on
torch's own threads, still spinning from the backward pass, instead of a second pool
competing with them for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from . import cache

__all__ = ["available", "backend", "info", "loaded", "load", "ABI", "SOURCES", "UNITS"]

_HERE = Path(__file__).parent
#: the translation units, compiled together in one call into one library
UNITS = tuple(_HERE / name for name in ("adamw.c", "measured.c", "support.c"))
#: every C source of the library, the units and the headers they include: the cache key
#: hashes them all
SOURCES = UNITS + tuple(_HERE / name for name in ("native.h", "rounding.h", "step.h",
                                                  "step_avx512.h"))
ABI = 7
# in order of preference: OpenMP (torch's own runtime once loaded), without, portable
_FLAGS = (("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"),
          ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"),
          ("-O3", "-ffp-contract=off", "-shared", "-fPIC"))

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_info: dict = {}


# ---------------------------------------------------------------------------------------
# build and load
# ---------------------------------------------------------------------------------------


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


def _sources_digest() -> str:
    """Each source's name and SHA-256, one per line: the part of the cache key that changes
    when any unit or header does."""
    return "\n".join(f"{path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}"
                     for path in SOURCES)


def _build(cc: list[str], flag_sets=_FLAGS) -> tuple[Path, bool]:
    """(path of the library, whether it was compiled now) with the first of ``flag_sets``
    that compiles; raises RuntimeError when none does. A cached library is reused only where
    ``cache`` trusts it: its directory, its file and its recorded SHA-256."""
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{cc[0]} --version failed: {error}") from None
    sources = _sources_digest().encode()
    directory = cache.build_dir()
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(b"\0".join([sources, version.encode(), " ".join(flags).encode(),
                                         _machine().encode()])).hexdigest()[:20]
        target = cache.trusted_target(directory / f"{cache.PREFIX}{key}.so")
        if cache.unchanged(target):
            return target, False
        try:
            _compile(cc, flags, target)
            return target, True
        except RuntimeError as error:
            errors.append(str(error))
    raise RuntimeError("compilation failed: " + " | ".join(errors))


def _compile(cc: list[str], flags: tuple[str, ...], target: Path) -> None:
    """Compile ``UNITS`` with ``flags`` into ``target`` (under a temporary name, then
    ``cache.install``); a RuntimeError with the compiler's message where it fails."""
    built = cache.new_file(target.parent)
    try:
        done = subprocess.run([*cc, *flags, "-o", str(built), *map(str, UNITS), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(flags)}: {done.stderr.strip()[-500:]}")
        cache.install(built, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{' '.join(flags)}: {error}") from None
    finally:
        if built.exists():
            built.unlink()


def load() -> ctypes.CDLL | None:
    """The library, built and loaded on first call; None where it is unavailable."""
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
    lib.collage_adamw_planned.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_int]
    lib.collage_adamw_planned.restype = ctypes.c_int
    lib.collage_nonfinite.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int]
    lib.collage_nonfinite.restype = ctypes.c_int
    lib.collage_adamw_measured.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.collage_adamw_measured.restype = ctypes.c_int
    lib.collage_stochastic_round.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int]
    lib.collage_stochastic_round.restype = ctypes.c_int
    lib.collage_residual_pairs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int]
    lib.collage_residual_pairs.restype = ctypes.c_int
    lib.collage_probe_over_bc2s.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                            ctypes.c_void_p]
    lib.collage_probe_over_bc2s.restype = ctypes.c_int
    lib.collage_stochastic_keys.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64]
    lib.collage_stochastic_keys.restype = None
    return lib


def available() -> bool:
    """Whether the native kernels are usable in this process (builds them on first call)."""
    return load() is not None


def backend() -> str | None:
    """``"avx512"`` or ``"portable"`` (the C build's instruction set), None if unavailable."""
    return _info.get("isa") if available() else None


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
        cache.reset()




def loaded() -> ctypes.CDLL | None:
    """The library if an earlier call loaded it, else None (never builds)."""
    return _lib
