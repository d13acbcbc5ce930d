"""Issue #3, criterion 5: checkpoint and resume is bit-exact, dtypes survive loading, and a
checkpoint of one strategy is refused by an optimizer of another."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import collage

from ._common import (
    ALL_STRATEGIES,
    RULE_CASES,
    RuleCase,
    assert_bitwise_equal,
    make_mlp,
    represented,
    roundtrip,
    snapshot,
    train_step,
    weight_dtype,
)

HALF = 10


@dataclass(frozen=True)
class ResumeCase:
    rule: RuleCase
    strategy: str
    path: str

    def __str__(self) -> str:
        return f"{self.rule}-{self.strategy}-{self.path}"


def _cases():
    for rule in RULE_CASES:
        for strategy in ALL_STRATEGIES:
            yield ResumeCase(rule, strategy, "foreach")
    adamw = RULE_CASES[0]
    for strategy in ("kahan", "stochastic", "plus", "split"):
        yield ResumeCase(adamw, strategy, "reference")


def _fresh(case: ResumeCase, model_seed: int, opt_seed: int):
    model = make_mlp(weight_dtype(case.strategy), seed=model_seed)
    opt = case.rule.make(model.parameters(), case.strategy, case.path, seed=opt_seed)
    return model, opt


@pytest.mark.parametrize("case", list(_cases()), ids=str)
def test_resume_is_bitwise_identical(case: ResumeCase) -> None:
    straight, straight_opt = _fresh(case, model_seed=0, opt_seed=5)
    for step in range(2 * HALF):
        train_step(straight, straight_opt, step)

    first, first_opt = _fresh(case, model_seed=0, opt_seed=5)
    for step in range(HALF):
        train_step(first, first_opt, step)
    dtypes = {k: v.dtype for k, v in snapshot(first, first_opt).items()}
    checkpoint = roundtrip({"model": first.state_dict(), "optim": first_opt.state_dict()})
    del first, first_opt

    # A fresh model (other initial weights) and optimizer (another seed: the stochastic
    # rounding stream must come from the checkpoint, not from the constructor).
    resumed, resumed_opt = _fresh(case, model_seed=1, opt_seed=99)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optim"])
    loaded = snapshot(resumed, resumed_opt)
    assert {k: v.dtype for k, v in loaded.items()} == dtypes  # no dtype changed on load
    for step in range(HALF, 2 * HALF):
        train_step(resumed, resumed_opt, step)

    assert_bitwise_equal(snapshot(straight, straight_opt), snapshot(resumed, resumed_opt))


@pytest.mark.parametrize("rule", RULE_CASES, ids=str)
def test_load_keeps_float32_states_of_bf16_weights(rule: RuleCase) -> None:
    """torch.optim casts floating-point state to the parameter's dtype on load; the fp32
    master and moments of 'mixed' must stay float32 while the weights are bf16."""
    model = make_mlp(torch.bfloat16)
    opt = rule.make(model.parameters(), "mixed")
    train_step(model, opt, 0)
    saved = roundtrip(opt.state_dict())
    fresh = make_mlp(torch.bfloat16, seed=1)
    fresh_opt = rule.make(fresh.parameters(), "mixed")
    fresh_opt.load_state_dict(saved)
    for param in fresh.parameters():
        state = fresh_opt.state[param]
        assert param.dtype == torch.bfloat16
        assert state["master"].dtype == torch.float32
        for key, value in state.items():
            if key != "step":
                assert value.dtype == torch.float32, key
        # the loaded master is the saved one, not a bf16 round trip of it
        original = opt.state[next(p for p, q in zip(model.parameters(), fresh.parameters())
                                  if q is param)]["master"]
        assert torch.equal(state["master"], original)


MISMATCHES = (("mixed", "plus"), ("plus", "light"), ("light", "bf16"), ("bf16", "stochastic"),
              ("split", "plus"), ("kahan", "bf16"))


@pytest.mark.parametrize(("saved", "loading"), MISMATCHES, ids=lambda s: s)
def test_loading_another_strategys_state_raises(saved: str, loading: str) -> None:
    rule = RULE_CASES[0]
    model = make_mlp(torch.bfloat16)
    opt = rule.make(model.parameters(), saved)
    train_step(model, opt, 0)
    checkpoint = roundtrip(opt.state_dict())
    other = make_mlp(torch.bfloat16)
    other_opt = rule.make(other.parameters(), loading)
    with pytest.raises(ValueError, match="strategy") as excinfo:
        other_opt.load_state_dict(checkpoint)
    message = str(excinfo.value)
    assert saved in message, message
    assert loading in message, message


#: precision of what load_full_precision can store of a float32 value: exact where the
#: strategy holds a float32 (or the bf16 value itself), 16 bits where it is a bf16 pair
FULL_PRECISION_RTOL = {"kahan": 2.0**-16, "light": 2.0**-16, "plus": 2.0**-16}


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_consolidate_then_load_full_precision(strategy: str) -> None:
    model = make_mlp(weight_dtype(strategy))
    opt = RULE_CASES[0].make(model.parameters(), strategy)
    for step in range(5):
        train_step(model, opt, step)
    full = collage.consolidate(model, opt)
    assert set(full) == set(model.state_dict()) and all(
        v.dtype == torch.float32 for v in full.values())
    fresh = make_mlp(weight_dtype(strategy), seed=3)
    fresh_opt = RULE_CASES[0].make(fresh.parameters(), strategy)
    collage.load_full_precision(fresh, fresh_opt, full)
    rtol = FULL_PRECISION_RTOL.get(strategy, 0.0)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        value = full[name].double()
        # consolidate is the represented value rounded once to float32
        assert torch.allclose(value, represented(opt, p), rtol=2.0**-24, atol=0.0), name
        # the fresh optimizer now represents that float32 value (to its storage precision)
        assert torch.allclose(represented(fresh_opt, q), value, rtol=rtol, atol=0.0), name
