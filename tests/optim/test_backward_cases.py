"""The step in backward where users train with it (issue #42): reentrant activation
checkpointing, backward passes that must not train (``opt.paused()``), several optimizers
over one model (``release_hooks``), hyperparameters changed between backwards, frozen
parameters.

The reference is always an optimizer of the same class stepping after backward
(``step()``), or the weights left untouched: nothing here computes an expected value with
the in-backward path.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import collage

from ._common import assert_bitwise_equal

BF16 = torch.bfloat16


class Shared(torch.nn.Module):
    """One weight used in two checkpointed segments and outside them (as a tied or shared
    layer is), one used only inside a segment, one only outside."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.shared = torch.nn.Parameter(torch.randn(8, 8, generator=g).to(BF16) / 3)
        self.inner = torch.nn.Parameter(torch.randn(8, 8, generator=g).to(BF16) / 3)
        self.head = torch.nn.Parameter(torch.randn(8, 1, generator=g).to(BF16) / 3)
        self.reentrant = reentrant

    def segment(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.shared @ self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.shared
        for _ in range(2):
            x = (self.segment(x) if self.reentrant is None
                 else checkpoint(self.segment, x, use_reentrant=self.reentrant))
        return x @ self.head


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(BF16) \
        .requires_grad_()


def _train(reentrant: bool | None, in_backward: bool, steps: int = 3,
           zero_grad: bool = True) -> dict:
    model = Shared(reentrant)
    opt = collage.AdamW(model.named_parameters(), lr=1e-2, strategy="plus",
                        step_in_backward=in_backward)
    for step in range(steps):
        model(_inputs(step)).float().square().mean().backward()
        opt.step()
        if zero_grad:
            opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()} | {
        f"{name}.step": opt.state[p]["step"] for name, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_weights_are_stepped_once_on_their_whole_gradient(reentrant):
    """Each weight once per iteration (3 steps, not one per segment), bit for bit step()'s
    weights, with reentrant checkpointing too (the hook sees each segment's part)."""
    stepped = _train(reentrant, in_backward=True)
    assert all(int(stepped[f"{n}.step"]) == 3 for n in ("shared", "inner", "head"))
    assert_bitwise_equal(stepped, _train(reentrant, in_backward=False))
    assert_bitwise_equal(stepped, _train(None, in_backward=False))  # checkpointing: same math


def test_the_documented_loop_needs_no_zero_grad_with_reentrant_checkpointing():
    """docs/memory.md's loop has no zero_grad: the gradients step() itself steps (here the
    reentrant segments' weights) are freed as the hooks free theirs, so the next backward
    does not add into them (it did: 'inner' stepped on two batches' gradients)."""
    assert_bitwise_equal(_train(True, in_backward=True, zero_grad=False),
                         _train(True, in_backward=False))


def test_a_weight_stepped_before_a_reentrant_segment_adds_to_it_is_refused():
    """Outside first, then inside a segment whose backward runs later: the step already
    used part of the gradient; refused, naming the parameter and the fix."""
    w = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    early = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    opt = collage.AdamW([("w", w), ("early", early)], lr=0.1, step_in_backward=True)
    x = torch.ones(3, dtype=BF16, requires_grad=True)
    # autograd runs the most recently recorded node first: w's own use, recorded after the
    # segment, completes w's gradient in the enclosing backward; the segment's nested
    # backward runs after and adds to it
    z = checkpoint(lambda t: (t * w).sum(), x * early, use_reentrant=True)
    y = (w * x).sum()
    with pytest.raises(RuntimeError, match=r"'w'.*use_reentrant=False"):
        (y + z).backward()


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.g = torch.nn.Linear(4, 4, dtype=BF16)
        self.d = torch.nn.Linear(4, 1, dtype=BF16)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("feature", [{"step_in_backward": True}, {"grad_accumulation": "pair"}],
                         ids=["step_in_backward", "pair"])
def test_a_paused_backward_trains_nothing_and_leaves_the_gradients(feature):
    """A GAN's generator loss through the discriminator: inside d_opt.paused(), the
    discriminator is not stepped, nothing is accumulated in the optimizer, and p.grad holds
    autograd's gradient as without the optimizer."""
    model, plain = _Pair(), _Pair()
    d_opt = collage.AdamW(model.d.parameters(), lr=0.1, **feature)
    before = {n: p.detach().clone() for n, p in model.d.named_parameters()}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2)).to(BF16)
    with d_opt.paused():
        model.d(model.g(x)).float().sum().backward()
    plain.d(plain.g(x)).float().sum().backward()
    assert_bitwise_equal({n: p.detach() for n, p in model.d.named_parameters()}, before)
    assert_bitwise_equal({n: p.grad for n, p in model.d.named_parameters()},
                         {n: p.grad for n, p in plain.d.named_parameters()})
    if "grad_accumulation" in feature:  # the optimizer holds nothing beyond p.grad
        assert all(torch.equal(d_opt.accumulated_grad(p), p.grad.float())
                   for p in model.d.parameters())
    # outside, the hooks work again
    d_opt.zero_grad()
    model.d(model.g(x)).float().sum().backward()
    if "step_in_backward" in feature:
        assert any(not torch.equal(p, before[n]) for n, p in model.d.named_parameters())


def test_a_paused_backward_left_before_step_is_refused_naming_paused():
    """A GAN loop that forgets to zero the discriminator's gradients: trained in one
    backward, then a generator backward under paused() writes p.grad again. step() refuses
    (it would step a second time), and the message names paused() and the fix, not DDP
    alone (no DDP runs here)."""
    model = _Pair()
    d_opt = collage.AdamW(model.d.parameters(), lr=0.1, step_in_backward=True)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2)).to(BF16)
    model.d(model.g(x).detach()).float().sum().backward()
    with d_opt.paused():
        model.d(model.g(x)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"opt\.paused\(\).*opt\.zero_grad\(\)"):
        d_opt.step()


def test_released_hooks_let_a_torch_optimizer_train_the_model():
    model, alone = torch.nn.Linear(4, 2, dtype=BF16), torch.nn.Linear(4, 2, dtype=BF16)
    alone.load_state_dict(model.state_dict())
    old = collage.AdamW(model.parameters(), lr=0.5, step_in_backward=True)
    old.release_hooks()
    assert not old.step_in_backward
    new, reference = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, alone))
    x = torch.ones(3, 4, dtype=BF16)
    for m, opt in ((model, new), (alone, reference)):
        m(x).float().sum().backward()
        opt.step()
    assert_bitwise_equal(dict(model.named_parameters()), dict(alone.named_parameters()))


def test_a_new_collage_optimizer_takes_the_hooks_of_an_older_one():
    model = torch.nn.Linear(4, 2, dtype=BF16)
    old = collage.AdamW(model.parameters(), lr=0.5, step_in_backward=True)
    with pytest.warns(RuntimeWarning, match="hooks are released"):
        new = collage.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.ones(3, 4, dtype=BF16)).float().sum().backward()
    # the old optimizer stepped nothing and took no gradient: the new one sees them
    assert_bitwise_equal({n: p.detach() for n, p in model.named_parameters()}, before)
    assert all(p.grad is not None for p in model.parameters())
    new.step()
    assert old.state == {} or all(int(s["step"]) == 0 for s in old.state.values())


def test_a_hyperparameter_changed_between_two_backwards_is_refused_before_it_moves_a_weight():
    model = torch.nn.Linear(4, 2, dtype=BF16)
    opt = collage.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    x = torch.ones(3, 4, dtype=BF16)
    model(x).float().sum().backward()  # stepped in backward
    opt.param_groups[0]["lr"] = -1.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="lr must be >= 0"):
        model(x).float().sum().backward()
    assert_bitwise_equal({n: p.detach() for n, p in model.named_parameters()}, before)


@pytest.mark.parametrize("feature", [{"step_in_backward": True}, {"grad_accumulation": "pair"}],
                         ids=["step_in_backward", "pair"])
def test_frozen_parameters_are_accepted_and_hooked_once_unfrozen(feature):
    """As torch.optim accepts them: a frozen parameter is left alone; unfrozen, it is
    trained as the optimizer's other parameters are (bit for bit a model trained with it
    unfrozen from the start, stepping after backward)."""
    def run(opt_flags: dict, freeze_first: bool, zero_grad: bool = True) -> dict:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=BF16),
                                    torch.nn.Linear(4, 1, dtype=BF16))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1))
        model[0].weight.requires_grad_(not freeze_first)
        opt = collage.AdamW(model.parameters(), lr=1e-2, **opt_flags)
        x = torch.ones(2, 4, dtype=BF16)
        frozen_at_start = model[0].weight.detach().clone()
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        if freeze_first:
            assert torch.equal(model[0].weight, frozen_at_start)
            model[0].weight.requires_grad_(True)
        for _ in range(2):
            model(x).float().sum().backward()
            opt.step()
            if zero_grad:
                opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    trained = run(feature, freeze_first=True)
    # the same schedule without the feature: stepping after backward
    assert_bitwise_equal(trained, run({}, freeze_first=True))
    if feature.get("step_in_backward"):
        # docs/memory.md's loop, no zero_grad after the unfreezing: the first gradient,
        # stepped by step() itself, is freed, not added into by the next backward
        assert_bitwise_equal(run(feature, freeze_first=True, zero_grad=False), trained)


@pytest.mark.parametrize("feature", [{"step_in_backward": True}, {"grad_accumulation": "pair"}],
                         ids=["step_in_backward", "pair"])
def test_a_dropped_model_and_optimizer_are_freed(feature):
    """The hooks stored on the parameters hold their hook set weakly: before, parameter ->
    hook -> hook set -> parameter was a cycle through autograd's hook storage, which the
    garbage collector does not see, and a dropped model and optimizer lived on (a
    comparison of many runs in one process kept every run's weights)."""
    model = torch.nn.Linear(8, 8, bias=False, dtype=BF16)
    opt = collage.AdamW(model.parameters(), lr=1e-3, **feature)
    for _ in range(2):
        model(torch.ones(2, 8, dtype=BF16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    weight, optimizer = weakref.ref(model.weight), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert weight() is None and optimizer() is None
