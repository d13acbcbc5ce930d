"""Issue #30, item 13: the reproducer of the reported abort at exit runs, and exits cleanly
with collage's optimizer (docs/distributed.md, "Known limitations", gives the counts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "abort_repro.py"


@pytest.mark.slow
def test_fsdp2_dcp_run_tears_down_without_abort():
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--optimizer", "collage", "--runs", "2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "collage: 0 of 2 runs aborted" in done.stdout
    assert done.stdout.count("exit codes [0, 0]") == 2, done.stdout[-4000:]
