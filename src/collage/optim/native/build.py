"""Building, caching and loading the native library.

**Sources.** ``SOURCES``, shipped with the package, split by concern (``native.h`` maps
them): ``native.h`` (layout, ABI, exported functions), ``rounding.h`` and ``stochastic.h``
(bit helpers: rounding to nearest; the draws and stochastic rounding), ``step.h`` and
``step_avx512.h`` (the per-element step, shared by the measured and unmeasured kernels),
and three translation units, ``UNITS``: ``adamw.c`` (unmeasured entry points),
``measured.c`` (the measured one), ``support.c`` (the rest).

**Build.** The units are compiled on first use with the system C compiler (``$CC``, else
``cc``, ``gcc``, ``clang``), each at once in a process of its own, ``cc -O3 -march=native
-ffp-contract=off -fopenmp -fPIC -c -o adamw.o adamw.c`` (and ``measured.c``,
``support.c``), then linked, ``cc ... -shared -o lib.so adamw.o measured.o support.o -lm``,
without torch headers, into ``$COLLAGE_CACHE_DIR/native/`` (default
``~/.cache/collage/native/``; ``$XDG_CACHE_HOME`` is honoured). Side by side, the build
takes as long as its largest unit (``measured.c``: about 13 s of wall time on AMD Zen 3,
against 23 s for the units one after the other). Separate units, rather than one file that
includes the others: each ``.c`` compiles on its own. The step is ``static inline`` code in
headers, so each entry point is compiled from the same code as when the library was one
file: the generated code is the same, instruction for instruction. The file name is a hash
of every source (units and headers: editing any of them rebuilds), the compiler's version,
the flags and the machine (architecture and CPU flags), so a new compiler or CPU builds a
new library and a cluster's shared home never loads another machine's code. The library is
written to a temporary name and renamed (concurrent processes never load a partial file).

**Trust** (``cache``, ``docs/security.md``). Native code is built in and loaded from a
directory only if no other user can write it or a directory above it, and a cached library
only if it and the record of its SHA-256 beside it are files of ours that no one else can
write and its bytes still have that digest; otherwise one warning, and a rebuild (in the
process's own ``mkdtemp`` directory where the cache itself is not private).

**Instruction sets** (#40). The sources select, from what the compiler targets, AVX-512
intrinsics (``__AVX512F__``, BW, VL: ``"avx512"``), else ``simd.h``'s vectors (x86-64 with
AVX2 and FMA: ``"avx2"``, 8 lanes; AArch64: ``"neon"``, 4 lanes), else a portable scalar
loop (``"portable"``), so they build on any machine. By default the library is built for
the CPU it runs on (``-march=native``); ``$COLLAGE_NATIVE_ISA`` forces a backend the CPU can
run: ``avx512``, ``avx2`` (``-mno-avx512f``: an AVX-512 machine tests and times the AVX2
kernels), ``vec128`` (NEON's width on x86: the same source at 4 lanes, ``-DCOLLAGE_VECTOR_
BYTES=16``; on AArch64 the native build itself), ``portable``, or ``auto`` (the default). A
backend this CPU cannot run warns once and builds the default. Every backend gives the same
bits. If ``-fopenmp`` or the target flags are refused (or the OpenMP build does not load)
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
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from . import cache

__all__ = ["available", "backend", "cpu_features", "info", "loaded", "load", "ABI", "ISAS",
           "SOURCES", "UNITS"]

_HERE = Path(__file__).parent
#: the translation units, compiled together in one call into one library
UNITS = tuple(_HERE / name for name in ("adamw.c", "measured.c", "support.c"))
#: every C source of the library, the units and the headers they include: the cache key
#: hashes them all
SOURCES = UNITS + tuple(_HERE / name for name in ("native.h", "rounding.h", "stochastic.h",
                                                  "simd.h", "rounding_vector.h", "step.h",
                                                  "step_avx512.h", "step_vector.h",
                                                  "lean_vector.h", "measure_vector.h",
                                                  "land_vector.h"))
ABI = 8
# in order of preference: OpenMP (torch's own runtime once loaded), without, portable
_FLAGS = (("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"),
          ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"),
          ("-O3", "-ffp-contract=off", "-shared", "-fPIC"))

#: the backends ``$COLLAGE_NATIVE_ISA`` may name (``auto``: the CPU's own, ``_FLAGS``)
ISAS = ("auto", "avx512", "avx2", "vec128", "portable")
#: collage_native_isa's codes (native.h's ISA_*); 3 is NEON on AArch64
_ISA_NAMES = {0: "portable", 1: "avx512", 2: "avx2", 3: "vec128"}
#: a forced backend's target flags on x86-64 (each the default's -march=native, narrowed)
#: and the CPU features it needs there (/proc/cpuinfo's names)
_X86_TARGETS = {
    "avx512": (("-march=native",), {"avx512f", "avx512bw", "avx512vl"}),
    "avx2": (("-march=native", "-mno-avx512f"), {"avx2", "fma"}),
    "vec128": (("-march=native", "-mno-avx512f", "-DCOLLAGE_VECTOR_BYTES=16"),
               {"avx2", "fma"}),
    "portable": (("-DCOLLAGE_SCALAR_ONLY",), set()),
}

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


def cpu_features() -> set[str]:
    """The CPU's feature names (x86 ``flags``, ARM ``Features`` of /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def requested_isa() -> str:
    """``$COLLAGE_NATIVE_ISA`` (default ``auto``); a ValueError naming the variable and its
    values where it is none of :data:`ISAS`."""
    isa = os.environ.get("COLLAGE_NATIVE_ISA", "auto").strip().lower() or "auto"
    if isa == "neon":
        isa = "vec128"
    if isa not in ISAS:
        raise ValueError(f"COLLAGE_NATIVE_ISA={isa!r} is not a native backend: use one of "
                         f"{', '.join(ISAS)} (or neon, the same as vec128), or unset it")
    return isa


def _target(isa: str) -> tuple[tuple[str, ...], list[str]]:
    """Backend ``isa``'s target flags (each the default's -march=native, narrowed) and the
    CPU features it needs that this CPU lacks (empty where it can run it). Besides
    :data:`ISAS` but ``auto``: ``"no-avx512bf16"``, the AVX-512 build that rounds with
    integer operations (tests)."""
    if isa == "no-avx512bf16":
        target, needs = ("-march=native", "-mno-avx512bf16"), {"avx512f", "avx512bw",
                                                               "avx512vl", "avx512_bf16"}
    elif isa == "portable":
        target, needs = ("-DCOLLAGE_SCALAR_ONLY",), set()
    elif _arm():
        if isa != "vec128":
            return (), [isa]
        target, needs = ("-march=native",), set()
    else:
        target, needs = _X86_TARGETS[isa]
    return target, sorted(needs - cpu_features())


def _flag_sets(isa: str) -> tuple[tuple[str, ...], ...]:
    """The flag sets to try, in order, for backend ``isa``: ``_FLAGS`` for ``auto`` (and
    for a backend this CPU cannot run, with one warning); else the forced backend's target
    with and without OpenMP, then the portable build."""
    if isa == "auto":
        return _FLAGS
    target, missing = _target(isa)
    if missing:
        warnings.warn(f"collage: COLLAGE_NATIVE_ISA={isa} needs CPU features this CPU lacks "
                      f"({', '.join(missing)}); building the default backend for this CPU",
                      RuntimeWarning, stacklevel=5)
        return _FLAGS
    base = ("-O3", *target, "-ffp-contract=off")
    return ((*base, "-fopenmp", "-shared", "-fPIC"), (*base, "-shared", "-fPIC"), _FLAGS[-1])


def build_backend(isa: str) -> ctypes.CDLL:
    """The library built for backend ``isa`` (see :func:`_target`), without OpenMP, in the
    cache directory, loaded beside (not instead of) the default one: for tests and
    benchmarks that compare backends in one process. A RuntimeError names what this CPU or
    compiler lacks."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    target, missing = _target(isa)
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)} for the {isa} backend")
    path, _ = _build(cc, [("-O3", *target, "-ffp-contract=off", "-shared", "-fPIC")])
    lib = _open(path)
    built = isa_name(lib.collage_native_isa())
    if isa != "no-avx512bf16" and built not in (isa, "neon"):
        raise RuntimeError(f"the {isa} build runs {built}")
    return lib


def isa_name(code: int) -> str:
    """The backend name of collage_native_isa's ``code`` (4 lanes on AArch64: ``neon``)."""
    name = _ISA_NAMES.get(code, f"unknown ({code})")
    return "neon" if name == "vec128" and _arm() else name


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
    ``cache.install``); a RuntimeError with the compiler's message where it fails. The
    units compile side by side, then link: the build waits for its largest unit alone
    (``measured.c``, about 13 s on AMD Zen 3, against 23 s for the three in one call)."""
    built = cache.new_file(target.parent)
    try:
        with tempfile.TemporaryDirectory(prefix="collage-objects-") as objects:
            paths = _compile_units(cc, flags, Path(objects))
            done = subprocess.run([*cc, *flags, "-o", str(built), *map(str, paths), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(flags)}: {done.stderr.strip()[-500:]}")
        cache.install(built, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{' '.join(flags)}: {error}") from None
    finally:
        if built.exists():
            built.unlink()


def _compile_units(cc: list[str], flags: tuple[str, ...], objects: Path) -> list[Path]:
    """Each of ``UNITS`` compiled to an object in ``objects``, all at once; their paths. A
    RuntimeError with the first failing unit's message; no compiler is left running."""
    unit_flags = [flag for flag in flags if flag != "-shared"]
    paths = [objects / f"{unit.stem}.o" for unit in UNITS]
    jobs = []
    try:
        for unit, path in zip(UNITS, paths):
            jobs.append(subprocess.Popen([*cc, *unit_flags, "-c", "-o", str(path), str(unit)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True))
        for job in jobs:
            _, errors = job.communicate(timeout=300)
            if job.returncode != 0:
                raise RuntimeError(f"{' '.join(flags)}: {errors.strip()[-500:]}")
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
            job.stderr.close()  # the pipes of the jobs not read after a failure
    return paths


def load() -> ctypes.CDLL | None:
    """The library, built and loaded on first call; None where it is unavailable."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        disabled = os.environ.get("COLLAGE_NATIVE", "1").strip().lower() in ("0", "false",
                                                                            "off", "no")
        isa = "auto" if disabled else requested_isa()  # a bad value raises every time
        _tried = True
        if disabled:
            _info.update(reason="disabled by COLLAGE_NATIVE=0")
            return None
        try:
            cc = _compiler()
            if cc is None:
                tried = "$CC=" + os.environ["CC"] if os.environ.get("CC") else "cc, gcc, clang"
                raise RuntimeError(f"no C compiler found ({tried})")
            flag_sets = _flag_sets(isa)
            path, compiled, lib = _build_and_open(cc, flag_sets)
        except Exception as error:  # never fatal: the inductor/foreach paths remain
            _info.update(reason=str(error))
            warnings.warn(f"collage: native CPU kernels unavailable ({error}); the CPU fused "
                          "path uses inductor kernels, the default path stays foreach "
                          "(set COLLAGE_NATIVE=0 to silence)", RuntimeWarning, stacklevel=4)
            return None
        _info.update(path=str(path), compiled=compiled, isa=isa_name(lib.collage_native_isa()),
                     requested_isa=isa, compiler=cc, reason=None, openmp=_openmp_runtime(lib))
        _warn_if_slower_than_the_cpu(_info["isa"], cc, flag_sets)
        _lib = lib
        return lib


def _warn_if_slower_than_the_cpu(built: str, cc: list[str],
                                 flag_sets: tuple[tuple[str, ...], ...]) -> None:
    """One warning where a build for this CPU (``flag_sets`` held -march=native) gave the
    portable loop on a CPU with vector units: the compiler lacks GCC 9's or Clang's vector
    extensions, or refused -march=native; the step then runs about 4-6x slower than the
    vector loop would on an AVX2 CPU. Not where the portable loop was asked for."""
    if built != "portable" or not any("-march=native" in flags for flags in flag_sets):
        return
    if not (_arm() or {"avx2", "fma"} <= cpu_features()):
        return
    warnings.warn(f"collage: the native CPU kernels were built without vector instructions "
                  f"({' '.join(cc)} does not support GCC >= 9's or Clang's vector "
                  "extensions, or refused -march=native): the step runs the portable "
                  "loop, several times slower; use a newer compiler ($CC)", RuntimeWarning,
                  stacklevel=5)


def _build_and_open(cc: list[str], flag_sets: tuple[tuple[str, ...], ...] | None = None
                    ) -> tuple[Path, bool, ctypes.CDLL]:
    """Build (or find) and load the first of ``flag_sets`` (default ``_FLAGS``) that compiles
    and loads (an OpenMP build whose runtime cannot be loaded falls through to the next)."""
    errors = []
    for flags in _FLAGS if flag_sets is None else flag_sets:
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
    """The loop the step runs on: ``"avx512"``, ``"avx2"``, ``"neon"``, ``"vec128"`` (NEON's
    width on x86, forced) or ``"portable"``; None if the library is unavailable."""
    return _info.get("isa") if available() else None


def info() -> dict:
    """What the loader did: path, compiled (now, vs. found in the cache), isa (the backend
    built), requested_isa (``$COLLAGE_NATIVE_ISA``), compiler, or the reason it is
    unavailable."""
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
