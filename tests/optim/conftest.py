"""Run the optimizer tests single-threaded.

Their tensors are tiny: with several intra-op threads on a shared, loaded machine every
small op pays a thread wake-up (measured: a 16-wide MLP step 100x slower). Restored after.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from collage.optim import native
from collage.optim.native import build

try:  # Triton is optional: without it the Triton tests skip
    import triton.language as tl
    from triton.runtime import interpreter
except ImportError:
    tl = interpreter = None

#: the native backends besides the default one that the bit-for-bit tests also run
#: (build.build_backend): the portable scalar loop, the vector source at AVX2's and NEON's
#: widths, and the AVX-512 build that rounds with integer operations
OTHER_BACKENDS = ("portable", "avx2", "vec128", "no-avx512bf16")


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def inductor_only(monkeypatch):
    """The fused path with compiled (inductor) kernels on CPU too (not the native ones)."""
    monkeypatch.setattr(native, "covers", lambda *args, **kwargs: False)


#: their test ids (``-k "not isa_"`` leaves them out: .ci/run's oldest-torch stage)
BACKEND_IDS = tuple(f"isa_{name}" for name in OTHER_BACKENDS)


def _build_or_none(name: str):
    try:
        return build.build_backend(name)
    except RuntimeError:
        return None


@pytest.fixture(scope="session")
def backend_libs(tmp_path_factory):
    """name -> loaded library of each of OTHER_BACKENDS this CPU runs, built once per
    session (about 20 s of one core each, two at a time); a name is absent where the CPU or
    the compiler cannot build it, or where it is the default library's own backend."""
    if build._compiler() is None:
        return {}
    names = [name for name in OTHER_BACKENDS if name != native.backend()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLLAGE_CACHE_DIR", str(tmp_path_factory.mktemp("backends")))
        with ThreadPoolExecutor(max_workers=2) as pool:  # each build waits on a compiler
            built = dict(zip(names, pool.map(_build_or_none, names)))
    return {name: lib for name, lib in built.items() if lib is not None}


@pytest.fixture(params=OTHER_BACKENDS, ids=BACKEND_IDS)
def backend_lib(request, backend_libs):
    """One other backend's library (skipped where this machine cannot build it)."""
    if request.param not in backend_libs:
        pytest.skip(f"the {request.param} backend is the default here, or this CPU or "
                    "compiler cannot build it")
    return backend_libs[request.param]


@pytest.fixture(params=("default", *OTHER_BACKENDS), ids=("default", *BACKEND_IDS))
def kernel_lib(request, backend_libs):
    """The default library, then each other backend's (skipped where absent): for the tests
    of the kernels' roundings and division through their test hooks. A test may narrow the
    list with ``@pytest.mark.parametrize("kernel_lib", [...], indirect=True)``."""
    if request.param == "default":
        lib = native.loaded() or native.load()
        if lib is None:
            pytest.skip("native kernels unavailable")
        return lib
    if request.param not in backend_libs:
        pytest.skip(f"the {request.param} backend is the default here, or this CPU or "
                    "compiler cannot build it")
    return backend_libs[request.param]


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter for CPU tensors (read at each launch): the Triton test files
    use it for every test (``pytest.mark.usefixtures``)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _patch_language_once_a_launch(monkeypatch)


def _language_modules(fn) -> set[int]:
    """The ``triton.language`` modules a function's globals hold: the interpreter's own
    test of what it patches for that function (``_patch_lang``)."""
    return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}


def _patch_language_once_a_launch(monkeypatch) -> None:
    """Triton's interpreter patches ``triton.language`` for each launch (``_patch_lang``:
    ``inspect.getmembers`` over every builtin, about 1 ms) and, in Triton 3.8, again at
    every call of a ``@triton.jit`` helper inside the kernel, never restoring the repeat.
    The launch's patch is in place then, so the repeat changes nothing; skipping it took
    test_triton.py and test_triton_arithmetic.py from 163 to 116 s. Within a launch, a
    helper whose language modules the launch has patched skips it; any other patches them.
    A Triton without these internals is left as it is (slower)."""
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None:
        return
    launches: list[set[int]] = []  # the modules each running launch has patched
    launch = executor.__call__

    def once_a_launch(fn):
        modules = _language_modules(fn)
        if launches and modules <= launches[-1]:
            return scope_type()  # nothing to do: restoring it restores nothing
        if launches:
            launches[-1] |= modules
        return patch_lang(fn)

    def launch_and_forget(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    monkeypatch.setattr(interpreter, "_patch_lang", once_a_launch)
    monkeypatch.setattr(executor, "__call__", launch_and_forget)
