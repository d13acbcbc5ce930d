"""Two rules of the source tree (issue #41): no file under ``src/`` over :data:`MAX_LINES`
lines, and no precision strategy named by a string literal outside its definition
(``collage/optim/strategies/``).

Why the second: a strategy is one object, defined once. Code elsewhere names one through
the registry (``strategies.NAMES.plus``, ``MAIN_STRATEGIES``, ``DEFAULT_STRATEGY``) or asks
it a property (``strategy.native_code``, ``strategy.opt_in``), so that a misspelt or removed
name fails at import and nothing compares a name in ten places. Python files are parsed with
``ast`` (comments and prose inside longer strings do not count); a string constant equal to
a registered name counts, except the names of an ``__all__`` (they name Python objects, such
as ``collage.mcf.split``) and :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from collage.optim.strategies import (DEFAULT_STRATEGY, MAIN_STRATEGIES, NAMES, STRATEGIES,
                                      get_strategy)

SOURCE = Path(__file__).resolve().parents[1] / "src"
#: the most lines a source file may hold
MAX_LINES = 550
#: what counts as a source file
SUFFIXES = (".py", ".c", ".h")
#: where the strategies are defined, relative to ``src/``
DEFINITIONS = "collage/optim/strategies"
#: string constants equal to a strategy name that are not one: (file, value) -> why
ALLOWED = {
    ("collage/integrations.py", "bf16"):
        "transformers' TrainingArguments.bf16 flag, read with getattr (an argument object "
        "may lack it)",
    ("collage/optim/triton/layout.py", "fp32"):
        "Triton's name of the float32 type in a kernel signature",
}


class Literal(NamedTuple):
    path: str  # relative to the root, with forward slashes
    line: int
    value: str


def source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*")
                  if p.suffix in SUFFIXES and p.is_file() and "__pycache__" not in p.parts)


def long_files(root: Path, limit: int) -> list[str]:
    """``path: lines`` of every source file under ``root`` over ``limit`` lines."""
    out = []
    for path in source_files(root):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append(f"{path.relative_to(root).as_posix()}: {lines} lines")
    return out


def _exported(tree: ast.AST) -> set[int]:
    """The ids of the string constants listed in an ``__all__`` of ``tree``."""
    ids = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                   else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            ids |= {id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return ids


def strategy_literals(root: Path, names: Iterable[str], definitions: str) -> Iterator[Literal]:
    """Every string constant equal to one of ``names`` in the Python files under ``root``
    but those under ``root / definitions`` and the entries of an ``__all__``."""
    names = set(names)
    for path in source_files(root):
        relative = path.relative_to(root).as_posix()
        if path.suffix != ".py" or relative.startswith(definitions + "/"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        exported = _exported(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value in names and id(node) not in exported):
                yield Literal(relative, node.lineno, node.value)


def test_no_source_file_is_over_the_limit():
    assert source_files(SOURCE)  # the walk sees the tree
    too_long = long_files(SOURCE, MAX_LINES)
    assert not too_long, f"over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_no_strategy_name_is_a_literal_outside_its_definition():
    found = [f"{x.path}:{x.line}: {x.value!r}"
             for x in strategy_literals(SOURCE, STRATEGIES, DEFINITIONS)
             if (x.path, x.value) not in ALLOWED]
    assert not found, ("strategy names as literals (name them through "
                       "collage.optim.strategies.NAMES or a property):\n" + "\n".join(found))


def test_every_allowed_literal_is_still_needed():
    """The allowlist stays minimal: an entry whose literal is gone goes too."""
    seen = {(x.path, x.value) for x in strategy_literals(SOURCE, STRATEGIES, DEFINITIONS)}
    assert set(ALLOWED) <= seen, set(ALLOWED) - seen


def test_the_registry_names_every_strategy():
    """What code outside the definitions names strategies through."""
    assert vars(NAMES) == {name: name for name in STRATEGIES}
    assert NAMES.plus in STRATEGIES  # attribute access: the form the rule asks for
    assert DEFAULT_STRATEGY in STRATEGIES
    assert MAIN_STRATEGIES == tuple(s for s in STRATEGIES if not get_strategy(s).opt_in)
    assert len(MAIN_STRATEGIES) == 8  # the main report's eight; plus8 and feedback opt in


# --------------------------------------------------------------------------------------------
# The checks themselves, on a small tree written for the purpose
# --------------------------------------------------------------------------------------------



def test_literals_are_found_where_they_stand_for_a_strategy(tmp_path, write_tree):
    write_tree({
        "pkg/strategies/plus.py": 'name = "plus"\n',
        "pkg/a.py": ('"""Uses the plus strategy."""\n__all__ = ["plus", "run"]\n'
                     'def run(strategy="plus"):\n    return strategy == "kahan"\n'
                     'MESSAGE = "use plus or kahan"\nKEYS = {"plus": 1}\n'),
        "pkg/b.py": '__all__ += ["kahan"]\nMODE = f"{1}kahan"\n',
        "pkg/native.h": '/* "plus" */\n',
    })
    found = set(strategy_literals(tmp_path, ("plus", "kahan"), "pkg/strategies"))
    assert found == {Literal("pkg/a.py", 3, "plus"), Literal("pkg/a.py", 4, "kahan"),
                     Literal("pkg/a.py", 6, "plus"), Literal("pkg/b.py", 2, "kahan")}


def test_long_files_of_every_source_kind_are_found(tmp_path, write_tree):
    write_tree({"pkg/short.py": "x = 1\n" * 3, "pkg/long.py": "x = 1\n" * 4,
                      "pkg/long.h": "/* */\n" * 4, "pkg/long.md": "text\n" * 9,
                      "pkg/__pycache__/long.py": "x = 1\n" * 9})
    assert long_files(tmp_path, 3) == ["pkg/long.h: 4 lines", "pkg/long.py: 4 lines"]
