"""The torch releases we claim are the ones CI tests (issue #33): pyproject's ``torch>=``
floor, the README's supported range and ``.ci/run``'s pinned oldest release name the same
version, and the subset that ``.ci/run`` runs on it exists and covers what it says."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()


def _release(text: str) -> tuple[int, ...]:
    """``"2.8.0+cu128"`` -> ``(2, 8, 0)``."""
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group(0).split("."))


def _ci_value(name: str) -> str:
    found = re.findall(rf"^{name}=(\S+)$", CI, re.M)
    assert len(found) == 1, f".ci/run must set {name}= once"
    return found[0]


def _ci_array(name: str) -> list[str]:
    block = re.search(rf"^{name}=\((.*?)\)$", CI, re.M | re.S)
    assert block, f".ci/run must set the array {name}"
    return [w for line in block.group(1).splitlines()
            for w in shlex.split(line.split("#")[0])]


def _pyproject_floor() -> str:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    (torch_requirement,) = [d for d in dependencies if re.match(r"torch\b", d)]
    match = re.fullmatch(r"torch>=([\d.]+)", torch_requirement.replace(" ", ""))
    assert match, f"pyproject: torch must be required as torch>=X.Y, got {torch_requirement!r}"
    return match.group(1)


def test_pyproject_readme_and_ci_agree_on_the_oldest_torch():
    floor = _pyproject_floor()
    oldest = _ci_value("OLDEST_TORCH")
    assert re.fullmatch(r"\d+\.\d+\.\d+", oldest), "pin the oldest torch exactly (X.Y.Z)"
    assert _release(oldest)[:2] == _release(floor)[:2] and _release(oldest) >= _release(floor)
    supported = re.search(r"Supported: Python >= [\d.]+, torch >= (\d+(?:\.\d+)*)", README)
    assert supported, "README must state 'Supported: Python >= X, torch >= Y'"
    assert supported.group(1) == floor
    assert f"torch {oldest}" in README  # the exact release CI installs


def test_ci_installs_the_pinned_release_and_runs_the_subset_on_it():
    assert re.search(r'pip install -q "torch==\$OLDEST_TORCH"', CI)
    assert '"${OLDEST_TORCH_TESTS[@]}"' in CI and '-k "$OLDEST_TORCH_DESELECT"' in CI
    # after the README's command, not instead of it
    assert CI.index("python -m pytest -q\n") < CI.index('"${OLDEST_TORCH_TESTS[@]}"')


def test_the_subset_exists_and_covers_what_it_claims():
    tests = _ci_array("OLDEST_TORCH_TESTS")
    missing = [t for t in tests if not (ROOT / t).is_file()]
    assert not missing, f".ci/run lists tests that do not exist: {missing}"
    covered = {
        "the optimizers against torch": "tests/optim/test_torch_parity.py",
        "the native kernels": "tests/optim/test_native.py",
        "DCP": "tests/distributed/test_checkpoint.py",
        "DDP and FSDP2": "tests/distributed/test_data_parallel.py",
        "the harness": "tests/train/test_runner.py",
    }
    for what, path in covered.items():
        assert path in tests, f"the oldest-torch subset must cover {what} ({path})"


def test_this_torch_is_within_the_supported_range():
    assert _release(torch.__version__) >= _release(_pyproject_floor())
