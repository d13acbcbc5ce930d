"""The numeric claims of the README and the docs that a test can pin, executed: a sentence
or table that goes stale fails CI (issue #25).

* bytes per parameter (README's table, docs/strategies.md's "At a glance") against the
  memory model derived from the strategies' components;
* the second-moment table of docs/strategies.md (``benchmarks/second_moment.py --check``);
* the research-plus table of docs/research_plus.md (``benchmarks/research_plus.py
  --check``);
* ``lr = 0`` leaves every weight and compensation term bitwise unchanged:
  ``tests/reliability/test_fuzz.py::test_lr_zero_changes_no_weight`` (every rule, strategy
  and path);
* docs/reliability.md's table of what is set from an edited weight, against the strategies'
  declared components (below); that a step at ``lr = 0`` after an edit keeps the edited
  weights, and each "Weights written between steps" sentence that states a behaviour:
  ``tests/optim/test_edits.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import collage
from collage.optim import get_strategy
from collage.train.memory import bytes_per_param

ROOT = Path(__file__).resolve().parents[1]


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    """The cells of the markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _named_strategies(cell: str) -> list[str]:
    return re.findall(r"`([a-z0-9]+)`", cell)


def test_readme_bytes_per_parameter():
    rows = _table_rows((ROOT / "README.md").read_text(), "strategy | bytes/param")
    seen = set()
    for cells in rows:
        for name in _named_strategies(cells[0]):
            assert f"{bytes_per_param(name).total:g}" == cells[1].replace("9.06", "9.0625"), \
                (name, cells[1])
            seen.add(name)
    assert {"fp32", "mixed", "plus", "split", "light", "kahan", "bf16", "stochastic",
            "plus8"} <= seen


def test_strategies_page_bytes_per_parameter():
    rows = _table_rows((ROOT / "docs" / "strategies.md").read_text(), "strategy | weights")
    for cells in rows:
        (name,) = _named_strategies(cells[0])
        documented = float(cells[-1].split()[0])
        assert abs(bytes_per_param(name).total - documented) < 0.01, (name, documented)


@pytest.mark.parametrize("script", ["second_moment.py", "research_plus.py"])
def test_generated_tables_are_what_the_code_computes(script):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--check"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_reliability_edit_table_names_what_each_strategy_keeps_beside_the_weight():
    """Each row's strategies keep exactly the components its second cell names beside the
    weight (roles master, low, compensation), each set as the third cell says; together
    the rows name every strategy."""
    rows = _table_rows((ROOT / "docs" / "reliability.md").read_text(),
                       "strategy | kept beside the weight")
    seen = set()
    for names, kept, set_to in rows:
        keys = set(re.findall(r"`([a-z_]+)`", kept))
        for name in _named_strategies(names):
            strategy = get_strategy(name)
            declared = {c.key for dtype in strategy.weight_dtypes
                        for c in strategy.weight_components(dtype)
                        if c.role in ("master", "low", "compensation")}
            assert declared == keys, (name, declared, kept)
            seen.add(name)
        for key in keys:
            assert f"`{key} = " in set_to, (names, key)
    assert seen == set(collage.STRATEGIES)
