"""UpdateStats.reduce_ across 2 gloo processes equals one process on the whole tensors.

Each rank (a separate ``python _dist_worker.py`` process, FileStore rendezvous in tmp_path)
holds different, unevenly sized shards of three parameters; after ``reduce_()`` every rank's
``to_dict()`` must equal the single-process result on the concatenated tensors and the
brute-force reference. A failing rank exits non-zero, which fails this test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_dist_worker.py"
WORLD = 2


@pytest.mark.distributed
def test_reduce_over_two_ranks_equals_single_process(tmp_path: Path) -> None:
    init_file = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD), str(init_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    codes = [proc.returncode for proc in procs]
    assert codes == [0] * WORLD, "\n".join(
        f"--- rank {r} (exit {c}) ---\n{out}" for r, (c, out) in enumerate(zip(codes, outputs))
    )
    assert all(f"rank {r}: ok" in out for r, out in enumerate(outputs))
