"""Fixtures shared by the top-level tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_tree(tmp_path: Path) -> Callable[[dict[str, str]], Path]:
    """Write ``{relative path: text}`` under ``tmp_path`` (folders made as needed) and return
    ``tmp_path``: a small source tree for the checks of test_imports and test_layout."""
    def write(files: dict[str, str]) -> Path:
        for name, text in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return tmp_path
    return write
