"""The README's commands are the ones CI runs, and the numbers it shows are the code's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import collage

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _setup_block() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block, "README must open with a bash block of set-up commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_install_test_and_main_job():
    install, test, main_job = _setup_block()
    assert install == 'pip install -e ".[dev]"'
    assert test == "python -m pytest -q"
    assert main_job.startswith("collage compare --preset quick")


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    _, test, _ = _setup_block()
    assert re.search(rf"^{re.escape(test)}$", ci, re.M), ".ci/run must run the README's command"
    assert 'pip install -e ".[dev]"' in ci


def test_cli_version_and_help():
    out = subprocess.run([sys.executable, "-m", "collage", "--version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"collage {collage.__version__}"
    out = subprocess.run([sys.executable, "-m", "collage", "--help"],
                         capture_output=True, text=True, check=True)
    for command in ("compare", "train", "memory"):
        assert command in out.stdout


def test_readme_memory_table_matches_the_memory_model():
    from collage.train.memory import bytes_per_param

    rows = dict(re.findall(r"^\| `(\w+)`[^|]*\| ([\d.]+) \|", README, re.M))
    assert rows, "README memory table not found"
    for strategy, expected in rows.items():
        assert round(bytes_per_param(strategy).total, 2) == float(expected), strategy
    assert "plus8" in rows


#: The distribution that provides an importable module, where their names differ.
DISTRIBUTIONS = {"optimi": "torch-optimi"}


def test_ci_installs_every_package_a_test_skips_without():
    """CI installs the dev extra; a test that skips for a missing package would silently
    not run there, so every module a test ``importorskip``s must come with the extra."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        dev = tomllib.load(handle)["project"]["optional-dependencies"]["dev"]
    installed = {re.split(r"[<>=!\[ ]", requirement)[0].lower() for requirement in dev}
    skipped = {name for path in (ROOT / "tests").rglob("*.py")
               for name in re.findall(r"importorskip\(\"([\w.]+)\"", path.read_text())}
    assert {"lightning", "datasets", "optimi"} <= skipped  # the guard sees them
    missing = {DISTRIBUTIONS.get(n, n) for n in skipped} - installed
    assert not missing, f"add to the dev extra: {sorted(missing)}"
    assert {"torchao", "tokenizers"} <= installed
