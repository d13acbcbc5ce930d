"""Issue #3, criterion 6: the optimizers work with the rest of PyTorch."""

from __future__ import annotations

import math

import pytest
import torch

import collage

from ._common import (
    BF16,
    FP32,
    PATHS,
    RULE_CASES,
    RuleCase,
    assert_bitwise_equal,
    bits,
    loss_of,
    make_mlp,
    represented,
    snapshot,
    train_step,
)


def _grads_from(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------
# learning-rate schedules
# ------------------------------------------------------------------------------------------

SCHEDULES = {
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch),
}


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_lr_scheduler_drives_the_step(schedule: str, tensor_lr: bool) -> None:
    """The scheduler changes lr, and each step uses the lr in effect: the same run with lr
    set by hand to the recorded values is bit for bit identical."""
    lr0 = torch.tensor(0.05) if tensor_lr else 0.05
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), lr=lr0, strategy="plus")
    scheduler = SCHEDULES[schedule](opt)
    used = []
    for step in range(5):
        used.append(float(opt.param_groups[0]["lr"]))
        train_step(model, opt, step)
        scheduler.step()
    assert len(set(used)) == len(used), f"lr did not change: {used}"
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) == tensor_lr

    manual = make_mlp()
    manual_opt = collage.AdamW(manual.parameters(), lr=0.05, strategy="plus")
    for step, lr in enumerate(used):
        manual_opt.param_groups[0]["lr"] = lr
        train_step(manual, manual_opt, step)
    assert_bitwise_equal(snapshot(model, opt), snapshot(manual, manual_opt))

    # and lr matters: a constant lr gives different weights
    constant = make_mlp()
    constant_opt = collage.AdamW(constant.parameters(), lr=0.05, strategy="plus")
    for step in range(5):
        train_step(constant, constant_opt, step)
    assert not torch.equal(constant.fc1.weight, model.fc1.weight)


@pytest.mark.parametrize("path", ["reference", "foreach", "fused"])
def test_tensor_lr_is_read_as_torch_reads_it(path: str) -> None:
    """A 0-d tensor lr is used, every step: the fast paths compute ``1 - lr * wd`` and
    ``lr / (1 - beta1**t)`` as torch.optim.AdamW does from a tensor (float32 operations;
    test_torch_parity.py pins fp32 to torch bit for bit), so the run is a float lr's within
    a float32 rounding of those coefficients; the reference path (the research form) reads
    lr as a number: bit for bit a float lr's."""
    runs = []
    for lr in (torch.tensor(0.01), 0.01):
        model = make_mlp()
        opt = collage.AdamW(model.parameters(), lr=lr, strategy="plus", **PATHS[path])
        for step in range(3):
            train_step(model, opt, step)
        runs.append((model, opt))
    (tensor_model, tensor_opt), (float_model, float_opt) = runs
    if path == "reference":
        assert_bitwise_equal(snapshot(tensor_model, tensor_opt),
                             snapshot(float_model, float_opt))
        return
    for p, q in zip(tensor_model.parameters(), float_model.parameters()):
        a, b = represented(tensor_opt, p), represented(float_opt, q)
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


# ------------------------------------------------------------------------------------------
# gradient clipping, compiled models, parameter groups
# ------------------------------------------------------------------------------------------


def test_clip_grad_norm_then_step() -> None:
    """mixed + SGD(lr): the fp32 master moves by exactly -lr * (clipped gradient)."""
    lr, max_norm = 0.5, 0.01
    model = make_mlp()
    opt = collage.SGD(model.parameters(), lr=lr, strategy="mixed")
    loss_of(model, 0).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    assert float(total) > 10 * max_norm  # clipping is active
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in
                                                    model.parameters()]))
    # clip multiplies bf16 gradients by max_norm / total: one bf16 rounding each (2**-8)
    assert math.isclose(float(clipped), max_norm, rel_tol=2.0**-7)
    train_master = {p: p.detach().float() for p in model.parameters()}  # master == weight
    grads = {p: p.grad.float() for p in model.parameters()}
    opt.step()
    for p in model.parameters():
        expected = train_master[p] - grads[p] * lr
        # two float32 roundings (product, sum) on either side: within 4 ulps of the master
        assert torch.allclose(opt.state[p]["master"], expected, rtol=2.0**-22, atol=2.0**-30)


def test_compiled_model_trains() -> None:
    model = make_mlp()
    compiled = torch.compile(model)
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="plus")
    x, y = torch.randn(32, 8).to(BF16), torch.randn(32, 4).to(BF16)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x).float(), y.float())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
    # the compiled module computes with the parameters the optimizer updated
    with torch.no_grad():
        assert torch.allclose(compiled(x).float(), model(x).float(), rtol=2.0**-6, atol=2.0**-6)


def test_mixed_strategies_per_param_group() -> None:
    """'plus' for matrices, 'mixed' for norms and biases, from a "strategy" group key."""
    model = make_mlp()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opt = collage.AdamW([{"params": matrices}, {"params": vectors, "strategy": "mixed"}],
                        lr=1e-2, strategy="plus")
    assert [g["strategy"] for g in opt.param_groups] == ["plus", "mixed"]
    losses = [train_step(model, opt, step % 2) for step in range(20)]
    assert losses[-1] < losses[0]
    for p in matrices:
        state = opt.state[p]
        assert {"weight_lo", "exp_avg_sq_lo"} <= state.keys() and "master" not in state
        assert state["exp_avg"].dtype == BF16 and state["weight_lo"].dtype == BF16
    for p in vectors:
        state = opt.state[p]
        assert state["master"].dtype == FP32 and "weight_lo" not in state
        assert torch.equal(p.detach(), state["master"].to(BF16))


def test_add_param_group() -> None:
    model = make_mlp()
    opt = collage.AdamW([model.fc1.weight], lr=1e-2, strategy="plus")
    opt.add_param_group({"params": [model.fc2.weight], "strategy": "mixed", "lr": 1e-3})
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1]["strategy"] == "mixed"
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)  # defaults filled in
    before = model.fc2.weight.detach().clone()
    train_step(model, opt, 0)
    assert not torch.equal(before, model.fc2.weight)
    assert "master" in opt.state[model.fc2.weight]
    # an invalid group is refused and not left behind
    with pytest.raises(TypeError, match="float32"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 2


def test_zero_grad() -> None:
    model = make_mlp()
    opt = collage.AdamW(model.parameters())
    loss_of(model, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    loss_of(model, 0).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_repr_is_readable() -> None:
    text = repr(collage.AdamW(make_mlp().parameters(), lr=3e-4, strategy="plus"))
    assert text.startswith("AdamW (")
    for fragment in ("strategy: plus", "lr: 0.0003", "betas: (0.9, 0.999)", "weight_decay"):
        assert fragment in text, text


# ------------------------------------------------------------------------------------------
# maximize, closures, named parameters
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["reference", "foreach"])
@pytest.mark.parametrize("rule", RULE_CASES, ids=str)
def test_maximize_equals_minimizing_the_negated_loss(rule: RuleCase, path: str) -> None:
    up, down = make_mlp(), make_mlp()
    opt_up = rule.make(up.parameters(), "plus", path, maximize=True)
    opt_down = rule.make(down.parameters(), "plus", path)
    for step in range(4):
        for opt in (opt_up, opt_down):
            opt.zero_grad()
        loss_of(up, step).backward()
        for p, q in zip(up.parameters(), down.parameters()):
            q.grad = -p.grad  # the gradient of -loss, exactly (negation is exact)
        opt_up.step()
        opt_down.step()
    assert_bitwise_equal(snapshot(up, opt_up), snapshot(down, opt_down))
    assert not torch.equal(up.fc1.weight, make_mlp().fc1.weight)  # it did move


def test_step_with_closure_returns_the_loss() -> None:
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), lr=1e-2)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    before = model.fc1.weight.detach().clone()
    result = opt.step(closure)
    assert calls == [True]  # called once, with grad enabled (step itself runs no_grad)
    assert isinstance(result, torch.Tensor) and result.dim() == 0
    assert torch.equal(bits(result.detach()), bits(loss_of(make_mlp(), 0).detach()))
    assert not torch.equal(before, model.fc1.weight)
    assert opt.step() is None


def test_named_parameters_name_the_update_stats() -> None:
    model = make_mlp()
    opt = collage.AdamW(model.named_parameters(), lr=1e-2, strategy="plus", track_updates=True)
    train_step(model, opt, 0)
    names = [n for n, _ in model.named_parameters()]
    for name in names:
        assert f"edq/{name}" in opt.update_stats, sorted(opt.update_stats)
        assert f"imprecision/{name}" in opt.update_stats
    # plus lands an update up to its pair's 2**-16 relative rounding of |w| (~1e-5 here), a
    # 1e-3 fraction of an lr=1e-2 update: the effective descent quality is 1 within 2**-8
    assert abs(opt.update_stats["edq"] - 1.0) <= 2.0**-8
