"""torch.compile and collage optimizers.

A compiled *model* with an eager ``optimizer.step()`` is the usual set-up (the example's
``model`` mode). Compiling a whole training step, ``optimizer.step()`` included, must not let
dynamo/inductor trace the optimizer: inductor elides bf16 round trips (store as bf16, reload
as float32) unless ``emulate_precision_casts`` is on, and Collage's compensation terms *are*
such round trips (``weight_lo = new - float(bf16(new))``), so they would silently become 0.
These tests compile the step and require the eager result bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import collage

from ._examples import load_example

EXTRA = {"plus": "weight_lo", "kahan": "compensation", "split": "weight_low_bits",
         "stochastic": None, "mixed": "master"}


def _train(strategy: str, compiled: bool, shapes, steps: int = 3, **kwargs):
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(*s).to(torch.bfloat16)) for s in shapes]
    opt = collage.AdamW(weights, lr=1e-3, strategy=strategy, **kwargs)

    def step(grads):
        for w, g in zip(weights, grads):
            w.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        step([torch.randn(*s, generator=g).to(torch.bfloat16) for s in shapes])
    return weights, opt


def _assert_same(strategy, shapes, **kwargs):
    eager_w, eager_opt = _train(strategy, False, shapes, **kwargs)
    comp_w, comp_opt = _train(strategy, True, shapes, **kwargs)
    for a, b in zip(eager_w, comp_w):
        sa, sb = eager_opt.state[a], comp_opt.state[b]
        extra = EXTRA[strategy]
        if extra is not None:
            largest = float(sb[extra].float().abs().max())
            assert largest > 0, f"{extra} is all zeros after the compiled steps (eager: " \
                                f"{float(sa[extra].float().abs().max()):.3g})"
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
        assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["plus"])
def test_compiled_step_equals_eager(strategy):
    _assert_same(strategy, [(32, 32)])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["kahan", "split", "stochastic", "mixed"])
def test_compiled_step_equals_eager_other_strategies(strategy):
    _assert_same(strategy, [(32, 32)])


@pytest.mark.slow
def test_compiled_step_with_several_shapes():
    """Several parameter shapes: dynamo switches to dynamic shapes inside the step."""
    _assert_same("plus", [(32, 32), (64, 8), (8,)])


@pytest.mark.slow
def test_compiled_step_fused_kernels():
    _assert_same("plus", [(32, 32)], fused=True)


@pytest.mark.slow
def test_example_compiled_model_keeps_compensation():
    rows = load_example("compile_train_step").main(["--steps", "4", "--modes", "model"])
    eager, model = rows
    assert model["weight_lo_max"] > 0
    assert model["state_dtypes"] == eager["state_dtypes"] == ["torch.bfloat16"]
    assert abs(model["first_loss"] - eager["first_loss"]) < 1e-2
