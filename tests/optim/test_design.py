"""A strategy lives in one place (docs/design.md, "Adding a strategy"): a Strategy defined in
this file alone, registered, runs on every path, round-trips through ``state_dict`` and the
export, and is measured, with no edit anywhere else."""

from __future__ import annotations

import pytest
import torch

import collage
from collage.optim import compiled, strategies
from collage.optim.strategies.kahan import Kahan
from collage.optim.strategies.strategy import Component

from ._common import assert_bitwise_equal, make_mlp, roundtrip, snapshot, train_step


class HalfKahan(Kahan):
    """Kahan summation with the buffer in fp16: 11 significant bits of what each bf16 add
    lost instead of 8."""

    name = "halfkahan"
    summary = "Kahan-compensated update, the buffer in fp16"
    order = 100
    native_code = None

    def weight_components(self, weight_dtype):
        return (Component("param", weight_dtype, "weight", "w"),
                Component("compensation", torch.float16, "compensation", "fp16 buffer"))

    def set_from_full(self, param, state, value):
        param.copy_(collage.mcf.round_to(value, param.dtype))
        state["compensation"].copy_(collage.mcf.round_to(value - param.double(),
                                                         torch.float16))


@pytest.fixture
def halfkahan(monkeypatch):
    monkeypatch.setitem(strategies._BY_NAME, "halfkahan", HalfKahan())
    return "halfkahan"


def _paths():
    paths = {"reference": {"reference": True}, "per_tensor": {"foreach": False},
             "foreach": {"foreach": True}, "default": {}}
    if compiled.available():
        paths["compiled"] = {"fused": True}
    return paths


def test_a_registered_strategy_runs_on_every_path(halfkahan):
    results = {}
    for name, flags in _paths().items():
        model = make_mlp()
        opt = collage.AdamW(model.parameters(), lr=1e-2, strategy=halfkahan, **flags)
        for step in range(3):
            train_step(model, opt, step)
        state = opt.state[model.fc1.weight]
        assert state["compensation"].dtype == torch.float16
        assert state["compensation"].abs().max() > 0, name  # something was kept
        results[name] = snapshot(model, opt)
    assert_bitwise_equal(results["per_tensor"], results["foreach"])
    assert_bitwise_equal(results["default"], results["foreach"])  # not native: foreach


def test_a_registered_strategy_round_trips_and_exports(halfkahan):
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy=halfkahan, foreach=True,
                        track_updates=True)
    for step in range(2):
        train_step(model, opt, step)
    assert 0 < opt.update_stats["edq"] <= 1.5
    saved = roundtrip(opt.state_dict())
    fresh_model = make_mlp()
    fresh_model.load_state_dict(model.state_dict())
    fresh = collage.AdamW(fresh_model.parameters(), lr=1e-2, strategy=halfkahan, foreach=True,
                          track_updates=True)
    fresh.load_state_dict(saved)
    train_step(model, opt, 2)
    train_step(fresh_model, fresh, 2)
    assert_bitwise_equal(snapshot(model, opt), snapshot(fresh_model, fresh))
    full = collage.consolidate(model, opt)
    collage.load_full_precision(fresh_model, fresh, full)
    assert_bitwise_equal(collage.consolidate(fresh_model, fresh), full)


def test_a_wrong_loaded_layout_names_the_component(halfkahan):
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), strategy=halfkahan, foreach=True)
    train_step(model, opt, 0)
    saved = opt.state_dict()
    for state in saved["state"].values():
        state["compensation"] = state["compensation"].to(torch.bfloat16)
    with pytest.raises(ValueError, match="'compensation' is torch.bfloat16, not torch.float16"):
        collage.AdamW(model.parameters(), strategy=halfkahan).load_state_dict(saved)
