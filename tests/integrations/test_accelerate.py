"""Hugging Face Accelerate with a collage optimizer: ``examples/accelerate_train.py``.

``accelerator.prepare`` wraps the optimizer; ``save_state``/``load_state`` checkpoint it with
``torch.save``/``load_state_dict``. A fresh model resumed from the checkpoint must end with
the same weights and optimizer state as the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ._examples import EXAMPLES, load_example

pytest.importorskip("accelerate")


def test_accelerate_bf16_plus_resumes_exactly(tmp_path):
    result = load_example("accelerate_train").run(tmp_path, steps=6, batch_size=16)
    assert result["optimizer_type"] == "AcceleratedOptimizer"
    assert result["losses"][-1] < result["losses"][0]
    assert result["resumed_losses"] == result["losses"][3:]
    assert result["resumed_identical"]
    assert result["weight_dtypes"] == result["state_dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_ddp_on_two_cpu_ranks(tmp_path):
    """``torchrun --nproc-per-node 2``: Accelerate sets up DDP (gloo); same checks per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(29500 + os.getpid() % 1000),
           str(EXAMPLES / "accelerate_train.py"), "--out", str(tmp_path), "--steps", "6"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2, done.stdout
    assert all('"resumed_identical": true' in r and '"processes": 2' in r for r in results)
