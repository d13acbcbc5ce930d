"""``CollageOptimizer.clip_grad_norm_``: torch's clipping, bit for bit, and a finite norm that
spares the next step its non-finite check, only for the very gradients it measured."""

from __future__ import annotations

import warnings

import pytest
import torch

import collage
from collage.optim import dispatch
from collage.optim import nonfinite as nonfinite_policy

from ._common import PATHS, assert_bitwise_equal, loss_of, make_mlp, snapshot


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """Counts the non-finite checks (each reads every gradient) that steps run, with the
    gradients each reads: the check of gradient lists, and the one a step of every group
    by its native plan makes in its C call (``check=True``)."""
    calls: list[int] = []
    original, planned = nonfinite_policy.nonfinite_flag, dispatch.step_native_plans

    def counted(grads, **options):
        calls.append(len(grads))
        return original(grads, **options)

    def counted_plans(prepared, check):
        if check:
            calls.append(sum(len(p.plan_grads) for p in prepared if p is not None))
        return planned(prepared, check)

    monkeypatch.setattr(nonfinite_policy, "nonfinite_flag", counted)
    monkeypatch.setattr(dispatch, "step_native_plans", counted_plans)
    return calls


def _setup(strategy: str = "plus", path: str = "fused", nonfinite: str = "skip", step=0):
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy=strategy, nonfinite=nonfinite,
                        **PATHS[path])
    loss_of(model, step).backward()
    return model, opt


@pytest.mark.parametrize("path", ["reference", "foreach", "fused"])
@pytest.mark.parametrize("strategy", ["bf16", "light", "plus", "stochastic"])
@pytest.mark.parametrize("max_norm,norm_type", [(0.05, 2.0), (1e3, 2.0), (0.01, float("inf")),
                                                (0.3, 1.0)])
def test_same_clipping_and_step_as_torch(strategy, path, max_norm, norm_type):
    """opt.clip_grad_norm_ then step() leaves every weight, gradient and state bit for bit
    where torch.nn.utils.clip_grad_norm_ then step() does, and returns the same norm."""
    results = []
    for ours in (False, True):
        model, opt = _setup(strategy, path)
        for step in range(3):
            if step:
                opt.zero_grad()
                loss_of(model, step).backward()
            if ours:
                norm = opt.clip_grad_norm_(max_norm, norm_type)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
        results.append((norm, grads, snapshot(model, opt)))
    (norm_a, grads_a, state_a), (norm_b, grads_b, state_b) = results
    assert torch.equal(norm_a, norm_b)
    assert_bitwise_equal(grads_a, grads_b)
    assert_bitwise_equal(state_a, state_b)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_finite_norm_spares_the_check_once(checks, nonfinite):
    model, opt = _setup(nonfinite=nonfinite)
    norm = opt.clip_grad_norm_(1.0)
    assert torch.isfinite(norm)
    opt.step()
    assert checks == [] and opt.skipped_steps == 0
    opt.step()  # the same gradients again, no new clip: the proof was used up
    assert checks == [len(list(model.parameters()))]


def test_torch_clipping_proves_nothing(checks):
    model, opt = _setup()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert len(checks) == 1


@pytest.mark.parametrize("change", ["in_place", "replaced", "zeroed_and_recomputed"])
def test_gradients_changed_after_clipping_are_checked(checks, change):
    """An inf put into a gradient after the norm was taken is caught: the step is skipped
    and nothing moves."""
    model, opt = _setup()
    opt.clip_grad_norm_(1.0)
    weight = model.fc1.weight
    if change == "in_place":
        weight.grad.view(-1)[5] = float("inf")
    elif change == "replaced":
        poisoned = weight.grad.clone()
        poisoned.view(-1)[5] = float("nan")
        weight.grad = poisoned
    else:  # zero_grad(set_to_none=False) then backward: same tensors, new versions
        opt.zero_grad(set_to_none=False)
        loss_of(model, 1).backward()
        weight.grad.view(-1)[5] = float("inf")
    before = snapshot(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert len(checks) == 1 and opt.skipped_steps == 1
    assert any("fc1.weight" in str(w.message) or "param" in str(w.message) for w in caught)
    assert_bitwise_equal(before, snapshot(model, opt))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_gradients_give_a_non_finite_norm_and_a_skipped_step(value):
    model, opt = _setup()
    model.fc2.bias.grad[0] = value
    norm = opt.clip_grad_norm_(1.0)
    assert not torch.isfinite(norm)
    before = snapshot(model, opt)
    with pytest.warns(RuntimeWarning, match="skipped step"):
        opt.step()
    assert opt.skipped_steps == 1
    assert_bitwise_equal(before, snapshot(model, opt))


def test_non_finite_gradients_raise_under_raise():
    model, opt = _setup(nonfinite="raise")
    model.fc1.bias.grad[2] = float("nan")
    opt.clip_grad_norm_(1.0)
    with pytest.raises(FloatingPointError, match="group0.param1"):
        opt.step()


def test_a_norm_that_overflows_on_finite_gradients_does_not_skip(checks):
    """Finite float32 gradients of 1e30 square to inf: the 2-norm is inf, which proves
    nothing, so the step checks the gradients itself, finds them finite and steps (torch's
    clipping scales them by 1/inf = 0; weight decay still moves the weights)."""
    model = torch.nn.Linear(4, 2).float()
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="fp32")
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e30)
    norm = opt.clip_grad_norm_(1.0)
    assert torch.isinf(norm) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    before = model.weight.detach().clone()
    opt.step()
    assert len(checks) == 1 and opt.skipped_steps == 0
    assert not torch.equal(before, model.weight)


def test_the_zero_norm_type_proves_nothing(checks):
    """norm_type=0 counts non-zero elements, an inf among them: finite, so no proof."""
    model, opt = _setup()
    norm = opt.clip_grad_norm_(1e9, norm_type=0)
    assert torch.isfinite(norm)
    opt.step()
    assert len(checks) == 1


def test_only_the_optimizers_parameters_with_gradients():
    """Parameters without a gradient are left out, as torch's function leaves them; the
    norm is over this optimizer's parameters only."""
    model, opt = _setup()
    model.fc2.bias.grad = None
    others = torch.nn.Parameter(torch.ones(3))
    others.grad = torch.full((3,), 100.0)
    want = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], 1e9)
    assert torch.equal(opt.clip_grad_norm_(1e9), want)
    assert torch.equal(others.grad, torch.full((3,), 100.0))
