"""A nan or inf in one gradient of one parameter of a multi-parameter model (issue #8, item 4).

With ``nonfinite='skip'`` the step changes nothing: every weight, every compensation term
(``weight_lo``, ``compensation``, ``master``, ``weight_low_bits``), every state (moments and
their low parts, ``step``), the optimizer's step counter and the stochastic-rounding
generator are bitwise unchanged; ``skipped_steps`` grows by one and a warning names the
parameter. With ``'raise'`` a FloatingPointError names the parameter (and only it) and,
again, nothing changed. The same through ``torch.amp.GradScaler``, which decides by itself
and hands the optimizer ``found_inf``.

tests/optim/test_nonfinite.py already covers AdamW with bf16/fp32 weights for every strategy
on the foreach and reference paths (skip), and 'raise' for the default strategy; this file
adds what it does not: fp16 weights (whose moments are bf16) for every strategy and path, the
fused path, SGD and Lion, 'raise' for every strategy x path, several bad parameters across
param groups, unnamed parameters, and a real GradScaler skip for every fp16 strategy x path.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.amp import GradScaler

import collage

from ._support import (
    ALL_STRATEGIES,
    FP16_STRATEGIES,
    PATHS,
    assert_unchanged,
    path_kwargs,
    snapshot,
    weight_dtypes,
)

BAD_PARAM = "blocks.2.weight"


class Net(torch.nn.Module):
    """Four named parameters of different shapes, one of them a scalar-like vector."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, 3))
        self.scale = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.blocks(x) * self.scale


def _trained(strategy: str, dtype: torch.dtype, path: str, nonfinite: str, rule: str = "adamw"):
    """A model and an optimizer after two ordinary steps (non-trivial states everywhere)."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    kwargs = dict(strategy=strategy, nonfinite=nonfinite, **path_kwargs(path))
    if rule == "adamw":
        opt = collage.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    elif rule == "sgd":
        opt = collage.SGD(model.named_parameters(), lr=1e-2, momentum=0.9, **kwargs)
    else:
        opt = collage.Lion(model.named_parameters(), lr=1e-3, weight_decay=0.1, **kwargs)
    x = torch.randn(16, 6).to(dtype)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    assert opt.skipped_steps == 0 and opt._steps_taken == 2  # the setup itself was clean
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()  # fresh finite gradients for every parameter
    return model, opt


def _inject(model: torch.nn.Module, value: float) -> None:
    grad = dict(model.named_parameters())[BAD_PARAM].grad
    grad.view(-1)[5] = value


def _cases():
    for strategy in FP16_STRATEGIES:
        for path in PATHS:
            yield pytest.param(strategy, torch.float16, path, id=f"{strategy}-fp16-{path}")
    yield pytest.param("plus", torch.bfloat16, "fused", id="plus-bf16-fused")
    yield pytest.param("stochastic", torch.bfloat16, "fused", id="stochastic-bf16-fused")


@pytest.mark.parametrize("value", [math.nan, -math.inf], ids=["nan", "-inf"])
@pytest.mark.parametrize(("strategy", "dtype", "path"), list(_cases()))
def test_skip_changes_nothing(strategy, dtype, path, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fused fallback, if any
        model, opt = _trained(strategy, dtype, path, "skip")
    _inject(model, value)
    before = snapshot(opt)
    with pytest.warns(RuntimeWarning, match=BAD_PARAM.replace(".", r"\.")):
        opt.step()
    assert_unchanged(before, opt, skipped_delta=1)
    # and the next finite step proceeds normally from the untouched state
    opt.zero_grad()
    model(torch.randn(4, 6).to(dtype)).float().pow(2).mean().backward()
    opt.step()
    assert opt.skipped_steps == 1
    assert all(int(s["step"].item()) == 3 for s in opt.state.values())


@pytest.mark.parametrize("rule", ["sgd", "lion"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", ["kahan", "stochastic", "plus", "split"])
def test_skip_changes_nothing_sgd_lion(strategy, path, rule):
    model, opt = _trained(strategy, torch.bfloat16, path, "skip", rule)
    _inject(model, math.nan)
    before = snapshot(opt)
    with pytest.warns(RuntimeWarning, match=BAD_PARAM.replace(".", r"\.")):
        opt.step()
    assert_unchanged(before, opt, skipped_delta=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_raise_names_the_parameter_and_changes_nothing(strategy, path):
    dtype = weight_dtypes(strategy)[0]
    model, opt = _trained(strategy, dtype, path, "raise")
    _inject(model, math.inf)
    before = snapshot(opt)
    with pytest.raises(FloatingPointError) as info:
        opt.step()
    message = str(info.value)
    assert repr(BAD_PARAM) in message
    for name, _ in model.named_parameters():  # only the culprit is named
        if name != BAD_PARAM:
            assert repr(name) not in message
    assert_unchanged(before, opt, skipped_delta=0)


def test_raise_names_parameters_without_names():
    """Plain ``model.parameters()``: the error names the group and the position."""
    model = Net().to(torch.bfloat16)
    opt = collage.AdamW(model.parameters(), nonfinite="raise")
    model(torch.randn(2, 6).to(torch.bfloat16)).float().sum().backward()
    list(model.parameters())[2].grad.view(-1)[0] = math.inf  # blocks.2.weight
    with pytest.raises(FloatingPointError, match=r"'group0\.param2'"):
        opt.step()


def test_skip_names_every_bad_parameter_across_groups():
    model = Net().to(torch.bfloat16)
    named = dict(model.named_parameters())
    opt = collage.AdamW([
        {"params": [named["blocks.0.weight"], named["blocks.0.bias"]],
         "param_names": ["blocks.0.weight", "blocks.0.bias"], "strategy": "plus"},
        {"params": [named["blocks.2.weight"], named["blocks.2.bias"], named["scale"]],
         "param_names": ["blocks.2.weight", "blocks.2.bias", "scale"], "strategy": "kahan"},
    ])
    model(torch.randn(2, 6).to(torch.bfloat16)).float().sum().backward()
    opt.step()
    model(torch.randn(2, 6).to(torch.bfloat16)).float().sum().backward()
    named["blocks.0.bias"].grad[0] = math.nan
    named["scale"].grad[1] = -math.inf
    before = snapshot(opt)
    with pytest.warns(RuntimeWarning) as record:
        opt.step()
    text = " ".join(str(w.message) for w in record)
    assert "'blocks.0.bias'" in text and "'scale'" in text
    assert_unchanged(before, opt, skipped_delta=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", FP16_STRATEGIES)
def test_grad_scaler_overflow_changes_nothing(strategy, path):
    """fp16 + GradScaler: an overflowing scaled gradient makes the scaler skip the step (it
    passes ``found_inf`` to the optimizer); nothing changes, the step counters do not
    advance, and the scale halves."""
    _grad_scaler_skip(strategy, path)


def test_grad_scaler_skip_is_counted():
    """A skip decided by GradScaler counts in ``skipped_steps`` like any other skip (nonfinite.py:
    "GradScaler already checked every gradient; it skips (and we count) on overflow")."""
    opt = _grad_scaler_skip("plus", "foreach")
    assert opt.skipped_steps == 1, (
        f"a step skipped by GradScaler is not counted: skipped_steps == {opt.skipped_steps}")


def _grad_scaler_skip(strategy: str, path: str):
    torch.manual_seed(0)
    model = Net().to(torch.float16)
    opt = collage.AdamW(model.named_parameters(), lr=1e-3, strategy=strategy,
                        **path_kwargs(path))
    scaler = GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(8, 6).to(torch.float16)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    assert opt.skipped_steps == 0
    opt.zero_grad()
    scaler.scale(model(x).float().pow(2).mean()).backward()
    _inject(model, math.inf)  # as if the scaled gradient had overflowed fp16
    before = snapshot(opt)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    assert not hasattr(opt, "found_inf") or opt.found_inf is None
    assert_unchanged(before, opt, skipped_delta=None)
    return opt
