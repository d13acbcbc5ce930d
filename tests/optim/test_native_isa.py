"""``COLLAGE_NATIVE_ISA`` (#40): a backend forced by name, a bad name refused, a backend the
CPU cannot run left for the CPU's own with one warning (docs/cpu.md)."""

from __future__ import annotations

import warnings

import pytest

from collage.optim.native import build

pytestmark = pytest.mark.skipif(build._compiler() is None,
                                reason="no C compiler: the native kernels cannot be built")


@pytest.fixture
def fresh_loader():
    """A loader that has not tried yet; the default one restored after (from its cache)."""
    build._reset()
    yield
    build._reset()


def test_an_unknown_backend_is_refused_naming_the_variable(monkeypatch, fresh_loader):
    monkeypatch.setenv("COLLAGE_NATIVE_ISA", "avx3")
    with pytest.raises(ValueError, match=r"COLLAGE_NATIVE_ISA='avx3'.*auto, avx512, avx2"):
        build.load()
    with pytest.raises(ValueError):  # every time, not once
        build.load()


def test_a_forced_backend_is_built_and_reported(monkeypatch, tmp_path, fresh_loader):
    """The portable one (the quickest to build; the vector ones are built by the
    conftest.backend_libs fixture for the bit-for-bit tests)."""
    monkeypatch.setenv("COLLAGE_NATIVE_ISA", "portable")
    monkeypatch.setenv("COLLAGE_CACHE_DIR", str(tmp_path))
    assert build.backend() == "portable"
    assert build.info()["requested_isa"] == "portable"
    assert build.loaded().collage_native_isa() == 0


def test_neon_names_the_four_lane_build(monkeypatch):
    monkeypatch.setenv("COLLAGE_NATIVE_ISA", " NEON ")
    assert build.requested_isa() == "vec128"


def test_a_backend_this_cpu_lacks_warns_and_builds_the_default(monkeypatch):
    monkeypatch.setattr(build, "cpu_features", lambda: {"sse2"})
    monkeypatch.setattr(build, "_arm", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"COLLAGE_NATIVE_ISA=avx2 needs .*avx2, fma"):
        assert build._flag_sets("avx2") == build._FLAGS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build._flag_sets("portable")[0][:2] == ("-O3", "-DCOLLAGE_SCALAR_ONLY")
    with pytest.raises(RuntimeError, match="lacks avx512_bf16, avx512bw"):
        build.build_backend("no-avx512bf16")


def test_on_arm_only_the_four_lane_and_portable_builds_exist(monkeypatch):
    monkeypatch.setattr(build, "_arm", lambda: True)
    assert build._target("vec128") == (("-march=native",), [])
    assert build._target("avx2") == ((), ["avx2"])
    assert build.isa_name(3) == "neon"


def test_a_build_without_vectors_on_a_vector_cpu_warns(monkeypatch):
    """What an old compiler gives (no vector extensions): the portable loop, said once."""
    monkeypatch.setattr(build, "cpu_features", lambda: {"avx2", "fma"})
    monkeypatch.setattr(build, "_arm", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"without vector instructions .* use a newer"):
        build._warn_if_slower_than_the_cpu("portable", ["gcc-8"], build._FLAGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build._warn_if_slower_than_the_cpu("portable", ["gcc-8"], build._FLAGS[-1:])  # asked
        build._warn_if_slower_than_the_cpu("avx2", ["gcc"], build._FLAGS)
        monkeypatch.setattr(build, "cpu_features", lambda: {"sse2"})
        build._warn_if_slower_than_the_cpu("portable", ["gcc-8"], build._FLAGS)  # no faster
