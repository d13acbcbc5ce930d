"""Hugging Face Trainer with a collage optimizer: ``examples/hf_trainer_gpt2.py``.

Trainer checkpoints the optimizer with ``torch.save(optimizer.state_dict())`` and restores
it with ``optimizer.load_state_dict(torch.load(..., weights_only=True))``; the round trip
must keep every state tensor and its dtype, and a run resumed from a checkpoint must end
exactly where the uninterrupted run ends.
"""

from __future__ import annotations

import pytest
import torch

import collage
import collage.integrations

from ._examples import load_example


@pytest.mark.parametrize("strategy", collage.STRATEGIES)
def test_trainer_style_state_dict_round_trip_keeps_dtypes(tmp_path, strategy):
    """What Trainer does with optimizer.pt, without Trainer: all states, bits and dtypes."""
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(dtype)
    opt = collage.AdamW(collage.integrations.param_groups(model, 0.1), lr=1e-2,
                        strategy=strategy)
    for _ in range(3):
        model(torch.randn(4, 8, dtype=dtype)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    fresh = collage.AdamW(collage.integrations.param_groups(model, 0.1), lr=1e-2,
                          strategy=strategy)
    fresh.load_state_dict(torch.load(tmp_path / "optimizer.pt", map_location="cpu",
                                     weights_only=True))
    for p in model.parameters():
        saved, loaded = opt.state[p], fresh.state[p]
        assert saved.keys() == loaded.keys()
        for key in saved:
            assert loaded[key].dtype == saved[key].dtype, key
            assert torch.equal(loaded[key], saved[key]), key
    assert fresh.state_dict()["collage"]["steps_taken"] == 3



def test_trainer_resumes_plus_in_bf16_exactly(tmp_path):
    pytest.importorskip("transformers")
    result = load_example("hf_trainer_gpt2").run(tmp_path, steps=4, batch_size=4, block=32)
    losses, resumed = result["losses"], result["resumed_losses"]
    assert sorted(losses) == [1, 2, 3, 4]
    assert losses[4] < losses[1]  # it learns
    assert resumed == losses  # steps 3-4 after resuming from checkpoint-2 are the same
    assert result["resumed_identical"]  # weights and optimizer state, bit for bit
    assert result["weight_dtypes"] == ["torch.bfloat16"]  # Trainer did not upcast
    assert result["checkpoint_state_keys"] == ["exp_avg", "exp_avg_sq", "exp_avg_sq_lo",
                                               "step", "weight_lo"]
    assert result["checkpoint_state_dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mixed", "split"])
def test_trainer_resumes_other_strategies_exactly(tmp_path, strategy):
    pytest.importorskip("transformers")
    result = load_example("hf_trainer_gpt2").run(tmp_path, steps=4, strategy=strategy,
                                                 batch_size=4, block=32)
    assert result["resumed_identical"]
    want = {"mixed": ["torch.float32"], "split": ["torch.bfloat16", "torch.int16"]}[strategy]
    assert result["checkpoint_state_dtypes"] == want
