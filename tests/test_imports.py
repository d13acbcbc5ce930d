"""The layering of ``src/collage``: no import cycle, no import hidden in a function to dodge
one, and nothing below the command line imports it.

Every module is parsed with ``ast`` (nothing is imported), so the test sees imports that
only run on some paths (``if __name__ == "__main__"``, ``if TYPE_CHECKING``) as well.
Lazy imports of optional third-party packages inside functions stay legitimate: only
imports of collage's own modules are checked.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"
#: the only modules allowed to import ``collage.cli``: the command line's entry points
CLI_IMPORTERS = {"collage.cli", "collage.__main__"}


@dataclass(frozen=True)
class Import:
    """One import of a collage module: who imports what, where."""

    importer: str
    target: str
    line: int
    in_function: bool


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its own)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _base_of(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(node: ast.AST, importer: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules an import statement loads (``from a import b``: ``a.b`` when it is a
    module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _base_of(importer, is_package, node)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names]


class _Collector(ast.NodeVisitor):
    """Imports of ``package`` modules in one file, each marked inside a function or not."""

    def __init__(self, importer: str, is_package: bool, modules: set[str], package: str):
        self.importer, self.is_package = importer, is_package
        self.modules, self.package = modules, package
        self.depth = 0
        self.found: list[Import] = []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for target in _targets(node, self.importer, self.is_package, self.modules):
            if target == self.package or target.startswith(self.package + "."):
                self.found.append(Import(self.importer, target, node.lineno, self.depth > 0))

    visit_Import = visit_ImportFrom = _import


def collect_imports(root: Path, package: str = "collage") -> list[Import]:
    """Every import of a ``package`` module by a ``package`` module under ``root``."""
    names = module_names(root, package)
    found = []
    for name, path in names.items():
        collector = _Collector(name, path.name == "__init__.py", set(names), package)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found += collector.found
    return found


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def module_level_graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.in_function and imp.target != imp.importer:
            edges.setdefault(imp.importer, set()).add(imp.target)
    return edges


IMPORTS = collect_imports(SOURCE)


def test_the_parser_sees_the_package():
    """A guard for the tests below: they would pass vacuously on an empty list."""
    importers = {imp.importer for imp in IMPORTS}
    assert {"collage", "collage.cli", "collage.train.runner", "collage.bench.optimizer",
            "collage.optim.base"} <= importers
    assert ("collage.__main__", "collage.cli") in {(i.importer, i.target) for i in IMPORTS}


def test_no_import_cycle():
    cycle = find_cycle(module_level_graph(IMPORTS))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_collage_import_inside_a_function():
    """Imports of collage's modules belong at module level (an import inside a function
    hides a dependency, usually to dodge a cycle)."""
    inside = [f"{imp.importer}:{imp.line} imports {imp.target}" for imp in dict.fromkeys(IMPORTS)
              if imp.in_function]
    assert not inside, "\n".join(inside)


def test_only_the_entry_points_import_the_command_line():
    """``collage.cli`` sits on top: it imports the harness and the benchmarks, never the
    reverse (errors they raise live in ``collage.errors``)."""
    wrong = [f"{imp.importer}:{imp.line}" for imp in IMPORTS
             if imp.target == "collage.cli" and imp.importer not in CLI_IMPORTERS]
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------------------------
# The checks themselves, on a small package written for the purpose
# --------------------------------------------------------------------------------------------



def test_a_cycle_through_relative_imports_is_found(tmp_path, write_tree):
    write_tree({
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from . import a\n",
        "pkg/sub/a.py": "from .b import thing\n",
        "pkg/sub/b.py": "from ..top import value\nthing = 1\n",
        "pkg/top.py": "import pkg.sub.a\nvalue = 2\n",
    })
    graph = module_level_graph(collect_imports(tmp_path, "pkg"))
    assert graph["pkg.sub"] == {"pkg.sub.a"}
    assert graph["pkg.sub.b"] == {"pkg.top"}
    assert find_cycle(graph) == ["pkg.sub.a", "pkg.sub.b", "pkg.top", "pkg.sub.a"]


def test_function_level_and_guarded_imports_are_told_apart(tmp_path, write_tree):
    write_tree({
        "pkg/__init__.py": "",
        "pkg/a.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from .b import B\n\ndef f():\n    from . import c\n"
                     "    import json\n    return c\n"),
        "pkg/b.py": "from .a import f\nB = 1\n",
        "pkg/c.py": "",
    })
    imports = collect_imports(tmp_path, "pkg")
    assert {(i.target, i.in_function) for i in imports if i.importer == "pkg.a"} == {
        ("pkg.b", False), ("pkg.c", True)}
    assert find_cycle(module_level_graph(imports)) == ["pkg.a", "pkg.b", "pkg.a"]


@pytest.mark.parametrize("edges", [{}, {"a": {"b"}, "b": {"c"}}, {"a": {"b", "c"}, "b": {"c"}}])
def test_acyclic_graphs_have_no_cycle(edges):
    assert find_cycle(edges) is None
