"""PyTorch Lightning with a collage optimizer: ``examples/lightning_train.py``.

``configure_optimizers`` returns ``collage.AdamW``; ``precision="bf16-true"`` converts the
module to bf16 before the optimizer is made; Lightning steps through ``optimizer.step(
closure)`` and checkpoints ``optimizer.state_dict()``. Resuming a fresh module from the
epoch-1 checkpoint must reproduce the uninterrupted epoch 2 bit for bit. Skipped when
Lightning is not installed (``pip install lightning``).
"""

from __future__ import annotations

import pytest

from ._examples import load_example

pytest.importorskip("lightning")


def test_lightning_bf16_true_plus_resumes_exactly(tmp_path):
    result = load_example("lightning_train").run(tmp_path, epochs=2, batches_per_epoch=3,
                                                 batch_size=16)
    assert result["resumed_identical"]
    assert result["weight_dtypes"] == ["torch.bfloat16"]
    assert result["checkpoint_state_dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
def test_lightning_split_keeps_int16_state(tmp_path):
    result = load_example("lightning_train").run(tmp_path, epochs=2, strategy="split",
                                                 batches_per_epoch=3, batch_size=16)
    assert result["resumed_identical"]
    assert result["checkpoint_state_dtypes"] == ["torch.bfloat16", "torch.int16"]
