"""The NEON build, run: AArch64's vector step under qemu-user gives the scalar loop's bits.

No ARM machine exists here, so the Python suites cannot run the NEON kernels (they need an
AArch64 torch). This test compiles ``native_bits.c`` (the step's outputs on hard inputs, one
digest per strategy, flag set and entry point) with the library's units three times -- for
AArch64 with NEON (``step_vector.h`` at 4 lanes through ``arm_neon.h``), for AArch64 with
the scalar loop only, and for this x86 machine with the scalar loop -- runs the AArch64
builds under ``qemu-aarch64`` and compares:

* NEON against AArch64's scalar loop: every output bit (one architecture, one NaN rule);
* both against x86's scalar loop: every bit but NaN payloads, which are each
  architecture's own (x86's default NaN is 0xFFC00000, AArch64's 0x7FC00000, and which of
  two NaN operands an addition returns differs), as torch's own are on that machine; so
  also not ``split``'s measured counts, whose visible weight is the top half of its float32
  master, a NaN's payload where that master is NaN;
* and the x86 scalar loop is the reference the other suites check against the foreach path.

Where ``aarch64-linux-gnu-gcc`` or ``qemu-aarch64`` is missing the test skips, naming them
(Debian: ``apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user``).
Slow: three builds of the library (about a minute on one core).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from collage.optim.native import build

HERE = Path(__file__).parent
NATIVE = Path(build.__file__).parent
UNITS = [str(path) for path in build.UNITS]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found (Debian: apt-get install gcc-aarch64-linux-gnu "
                    "libc6-dev-arm64-cross qemu-user)")
    return path


def _lines(command: list[str], compiler: list[str], flags: list[str], target: Path) -> list:
    subprocess.run([*compiler, "-O2", "-ffp-contract=off", *flags, f"-I{NATIVE}", "-o",
                    str(target), str(HERE / "native_bits.c"), *UNITS, "-lm"], check=True,
                   capture_output=True, timeout=600)
    done = subprocess.run([*command, str(target)], check=True, capture_output=True,
                          text=True, timeout=600)
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 8 * 5 * 2 and all(words[4].startswith("exact=") for words in lines)
    assert all(words[3] == "status=0" for words in lines)
    return lines


@pytest.mark.slow
def test_neon_build_gives_the_scalar_bits(tmp_path) -> None:
    cross = _tool("aarch64-linux-gnu-gcc")
    qemu = _tool("qemu-aarch64")
    host = build._compiler()
    if host is None:
        pytest.skip("no C compiler for this machine")
    arm = [qemu, "-L", "/usr/aarch64-linux-gnu"]
    neon = _lines(arm, [cross], ["-march=armv8-a"], tmp_path / "neon")
    scalar = _lines(arm, [cross], ["-march=armv8-a", "-DCOLLAGE_SCALAR_ONLY"],
                    tmp_path / "scalar")
    x86 = _lines([], host, ["-DCOLLAGE_SCALAR_ONLY"], tmp_path / "x86")
    assert neon == scalar
    numbers = [[w for w in words if not w.startswith("exact=")] for words in neon]
    assert numbers == [[w for w in words if not w.startswith("exact=")] for words in x86]

