"""Issue #3, criterion 8: non-finite gradients and the GradScaler protocol."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

import collage

from ._common import (
    ALL_STRATEGIES,
    FP16,
    PATHS,
    RULE_CASES,
    assert_bitwise_equal,
    loss_of,
    make_mlp,
    snapshot,
    train_step,
    weight_dtype,
)


@dataclass(frozen=True)
class Poison:
    """Put ``value`` into one element of one gradient."""

    value: float
    param: str

    def __str__(self) -> str:
        return f"{self.value}-{self.param}"

    def apply(self, model) -> None:
        grad = dict(model.named_parameters())[self.param].grad
        grad.view(-1)[3] = self.value


POISONS = (Poison(float("nan"), "fc1.weight"), Poison(float("inf"), "norm.bias"),
           Poison(float("-inf"), "fc2.bias"))


def _poisoned_step(model, opt, step: int, poison: Poison):
    opt.zero_grad()
    loss_of(model, step).backward()
    poison.apply(model)
    return opt.step()


@pytest.mark.parametrize("path", ["reference", "foreach"])
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("poison", POISONS, ids=str)
def test_skip_leaves_everything_unchanged(poison: Poison, strategy: str, path: str) -> None:
    rule = RULE_CASES[0]
    model = make_mlp(weight_dtype(strategy))
    opt = rule.make(model.named_parameters(), strategy, path)
    for step in range(2):
        train_step(model, opt, step)
    before = snapshot(model, opt)
    steps_taken = opt.state_dict()["collage"]["steps_taken"]
    with pytest.warns(RuntimeWarning, match=rf"skipped step.*'{poison.param}'"):
        _poisoned_step(model, opt, 2, poison)
    assert_bitwise_equal(before, snapshot(model, opt))  # weights, compensations, states, steps
    assert opt.skipped_steps == 1
    assert opt.state_dict()["collage"]["steps_taken"] == steps_taken
    # (stochastic draws are keyed by the step counters, which the snapshot holds)
    # ... and the run continues exactly as if the bad step had never happened
    train_step(model, opt, 3)
    clean = make_mlp(weight_dtype(strategy))
    clean_opt = rule.make(clean.named_parameters(), strategy, path)
    for step in (0, 1, 3):
        train_step(clean, clean_opt, step)
    assert_bitwise_equal(snapshot(clean, clean_opt), snapshot(model, opt))
    assert opt.state_dict()["collage"]["skipped_steps"] == 1


@pytest.mark.parametrize("poison", POISONS, ids=str)
def test_raise_names_the_parameter_and_changes_nothing(poison: Poison) -> None:
    model = make_mlp()
    opt = collage.AdamW(model.named_parameters(), nonfinite="raise")
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    with pytest.raises(FloatingPointError, match=rf"non-finite gradient in parameter "
                                                 rf"'{poison.param}'"):
        _poisoned_step(model, opt, 1, poison)
    assert_bitwise_equal(before, snapshot(model, opt))


def test_ignore_proceeds() -> None:
    model = make_mlp()
    opt = collage.AdamW(model.named_parameters(), nonfinite="ignore", strategy="plus")
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skip warning
        _poisoned_step(model, opt, 1, Poison(float("nan"), "fc1.weight"))
    assert opt.skipped_steps == 0
    for name, param in model.named_parameters():
        assert int(opt.state[param]["step"]) == 2, name
        assert not torch.equal(before[f"param/{name}"], param.detach()), name  # all updated
    assert torch.isnan(model.fc1.weight).any()  # the nan went where it was told to go
    assert torch.isfinite(model.fc2.weight).all()


# ------------------------------------------------------------------------------------------
# GradScaler
# ------------------------------------------------------------------------------------------


def _scaled_run(strategy: str, path: str, scale: float | None, found_inf: float = 0.0,
                steps: int = 3):
    model = make_mlp(weight_dtype(strategy))
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy=strategy, **PATHS[path])
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, step)
        (loss * scale if scale is not None else loss).backward()
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
            opt.found_inf = torch.tensor(found_inf)
        try:
            opt.step()
        finally:
            if scale is not None:
                del opt.grad_scale, opt.found_inf
    return model, opt


def _scaler_cases():
    for strategy in ALL_STRATEGIES:
        yield pytest.param(strategy, "foreach", id=f"{strategy}-foreach")
    for strategy in ("plus", "stochastic", "kahan"):
        yield pytest.param(strategy, "reference", id=f"{strategy}-reference")
    yield pytest.param("plus", "fused", id="plus-fused")


@pytest.mark.parametrize(("strategy", "path"), list(_scaler_cases()))
def test_grad_scale_divides_the_gradients(strategy: str, path: str) -> None:
    """Gradients of loss * 1024 are exactly 1024 times those of loss (a power of two, no
    overflow here), so unscaling by grad_scale must reproduce the unscaled run bit for bit."""
    scaled, scaled_opt = _scaled_run(strategy, path, 1024.0)
    plain, plain_opt = _scaled_run(strategy, path, None)
    assert_bitwise_equal(snapshot(plain, plain_opt), snapshot(scaled, scaled_opt))


def test_found_inf_skips_the_step() -> None:
    model, opt = _scaled_run("plus", "foreach", 1024.0, steps=2)
    before = snapshot(model, opt)
    opt.zero_grad()
    (loss_of(model, 5) * 1024.0).backward()
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert_bitwise_equal(before, snapshot(model, opt))


def test_real_grad_scaler_with_fp16_plus() -> None:
    model = make_mlp(FP16)
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="plus")
    # 2**40 overflows fp16 gradients: the first step(s) must be skipped and the scale lowered
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    y = (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(4)) * 0.3).to(FP16)
    x = x.to(FP16)
    start = snapshot(model, opt)
    losses = []
    for step in range(40):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
        if step == 0:
            assert scaler.get_scale() < 2.0**40  # overflow seen, scale backed off
            assert_bitwise_equal(start, snapshot(model, opt))  # and the step was skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("path", ["foreach", "default"])
def test_a_checkpoint_after_a_refused_first_step_loads_as_one_never_stepped(path) -> None:
    """A non-finite gradient at the first step (GradScaler's usual start with fp16) refuses
    the step before any state is made: ``state_dict()`` saves no state for it, as
    torch.optim's, and both it and a state dict with the empty ``{}`` entries saved before
    that fix load, into a new optimizer and the same one; the next step is then bit for
    bit a fresh optimizer's first."""
    flags = {"foreach": True} if path == "foreach" else {}

    def made() -> tuple[list[torch.nn.Parameter], collage.AdamW]:
        g = torch.Generator().manual_seed(6)
        params = [torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16))
                  for n in (8, 5)]
        return params, collage.AdamW(params, lr=0.1, strategy="plus", **flags)

    def good_step(params, opt) -> dict[str, torch.Tensor]:
        for p in params:
            p.grad = torch.full_like(p, 0.25)
        opt.step()
        return {f"w{i}": p.detach().clone() for i, p in enumerate(params)}

    params, opt = made()
    params[0].grad = torch.ones_like(params[0])
    params[1].grad = torch.full_like(params[1], float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped step"):
        opt.step()
    saved = opt.state_dict()
    assert saved["state"] == {}
    older = {**saved, "state": {0: {}, 1: {}}}  # as saved before state_dict dropped them
    want = good_step(*made())
    for state_dict in (saved, older):
        fresh_params, fresh = made()
        fresh.load_state_dict(state_dict)
        assert_bitwise_equal(good_step(fresh_params, fresh), want)
    opt.load_state_dict(older)
    assert_bitwise_equal(good_step(params, opt), want)
