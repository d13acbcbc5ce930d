"""Drop-in without surprises (issue #20): what a user of torch.optim does to an optimizer,
and what collage does about it. One test per row of docs/reliability.md's table "what you
did -> what happens"; each failed on the code before the issue.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collage

from ._common import (
    ALL_STRATEGIES,
    assert_bitwise_equal,
    make_mlp,
    represented,
    roundtrip,
    snapshot,
    train_step,
    weight_dtype,
)

BF16 = torch.bfloat16


def _trained(strategy: str = "plus", steps: int = 2, **kwargs):
    model = make_mlp(weight_dtype(strategy))
    opt = collage.AdamW(model.named_parameters(), lr=1e-2, strategy=strategy, **kwargs)
    for step in range(steps):
        train_step(model, opt, step)
    return model, opt


# ----------------------------------------------------------------------------------------
# parameters changed after the optimizer made its state


@pytest.mark.parametrize("change", ["half", "to", "data"])
def test_a_converted_model_is_an_error_naming_the_parameter(change):
    model, opt = _trained("split")
    before = snapshot(model, opt)
    if change == "half":
        model.half()
    elif change == "to":
        model.to(torch.float32)
    else:
        model.fc1.weight.data = model.fc1.weight.data.to(torch.float16)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    with pytest.raises((TypeError, ValueError), match="fc1.weight"):
        opt.step()
    model.to(BF16)  # back: nothing was stepped
    after = snapshot(model, opt)
    assert_bitwise_equal({k: v for k, v in before.items() if k.startswith("state/")},
                         {k: v for k, v in after.items() if k.startswith("state/")})


def test_fp32_state_with_bf16_weights_is_an_error():
    model, opt = _trained("fp32")
    for p in model.parameters():
        p.data = p.data.to(BF16)
        p.grad = torch.full_like(p, 1e-3)
    with pytest.raises(TypeError, match="fp32.*float32|float32.*fp32"):
        opt.step()


def test_a_state_of_another_shape_is_an_error_on_the_default_path():
    weight = torch.nn.Parameter(torch.randn(3, 4).to(BF16))
    opt = collage.AdamW([weight], strategy="plus")
    weight.grad = torch.ones_like(weight)
    opt.step()
    state = opt.state_dict()
    for value in state["state"][0].values():
        if value.dim():
            value.data = value.reshape(4, 3)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(state)


def test_the_same_parameter_twice_is_refused():
    weight = torch.nn.Parameter(torch.randn(4).to(BF16))
    with pytest.raises(ValueError, match="twice"):
        collage.AdamW([weight, weight])


# ----------------------------------------------------------------------------------------
# copies


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("strategy", ["plus", "stochastic", "mixed", "plus8"])
def test_copies_continue_bit_for_bit(how, strategy):
    """plus8's float8 moments too: torch pickles a float8 tensor but cannot unpickle it
    (2.14), so they travel as uint8 views (``state_io._AsBytes``)."""
    model, opt = _trained(strategy)
    # copied together, so that the copy's optimizer steps the copy's parameters
    if how == "deepcopy":
        twin_model, twin = copy.deepcopy((model, opt))
    else:
        twin_model, twin = pickle.loads(pickle.dumps((model, opt)))
    for step in range(2, 5):
        train_step(model, opt, step)
        train_step(twin_model, twin, step)
    assert_bitwise_equal(snapshot(model, opt), snapshot(twin_model, twin))
    assert twin.skipped_steps == opt.skipped_steps and twin.seed == opt.seed


# ----------------------------------------------------------------------------------------
# loading


def test_a_torch_adamw_state_loads_and_continues_as_torch():
    torch.manual_seed(0)
    ours_model, theirs_model = make_mlp(torch.float32), make_mlp(torch.float32)
    theirs = torch.optim.AdamW(theirs_model.parameters(), lr=1e-2, weight_decay=0.1,
                               foreach=False)
    for step in range(3):
        train_step(theirs_model, theirs, step)
    ours_model.load_state_dict(theirs_model.state_dict())
    ours = collage.AdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.1, strategy="fp32",
                         foreach=True)
    ours.load_state_dict(roundtrip(theirs.state_dict()))
    for step in range(3, 6):
        train_step(theirs_model, theirs, step)
        train_step(ours_model, ours, step)
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["plus", "light", "bf16", "mixed", "plus8"])
def test_a_torch_state_migrates_to_any_strategy(strategy):
    """An fp32 run's moments, stored as the strategy stores float32 values: a pair's sum is
    the float32 moment to 16 bits, a bf16 moment its rounding, mixed keeps it exactly."""
    fp32_model = make_mlp(torch.float32)
    theirs = torch.optim.AdamW(fp32_model.parameters(), lr=1e-2)
    for step in range(3):
        train_step(fp32_model, theirs, step)
    model = make_mlp(BF16)
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy=strategy)
    collage.load_full_precision(model, opt, fp32_model.state_dict())
    opt.load_state_dict(theirs.state_dict())
    rule = opt.rule
    strat = collage.optim.get_strategy(strategy)
    for p, q in zip(model.parameters(), fp32_model.parameters()):
        want_v = theirs.state[q]["exp_avg_sq"].double()
        got_v = strat.moment_value(rule, opt.state[p], "exp_avg_sq")
        tolerance = {"mixed": 0.0, "plus": 2.0**-16, "plus8": 2.0**-9}.get(strategy, 2.0**-8)
        assert ((got_v - want_v).abs() <= tolerance * want_v.abs() + 1e-30).all()
        assert float(opt.state[p]["step"]) == 3.0
        # the weight as load_full_precision set it (hi + lo, or the master)
        rel = (represented(opt, p) - q.double()).abs() / q.double().abs().clamp(min=1e-30)
        assert rel.max() <= (2.0**-8 if strategy == "bf16" else 2.0**-16)
    train_step(model, opt, 3)  # and it steps


def test_a_rejected_state_leaves_the_optimizer_as_it_was():
    model, opt = _trained("plus")
    before = snapshot(model, opt)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                   for g in opt.param_groups])
    bad = roundtrip(opt.state_dict())
    bad["state"][len(bad["state"]) - 1]["exp_avg_sq_lo"] = \
        bad["state"][len(bad["state"]) - 1]["exp_avg_sq_lo"].float()
    bad["param_groups"][0]["lr"] = 0.5  # would be loaded first by torch.optim
    with pytest.raises(ValueError, match="exp_avg_sq_lo"):
        opt.load_state_dict(bad)
    assert_bitwise_equal(before, snapshot(model, opt))
    assert [{k: v for k, v in g.items() if k != "params"}
            for g in opt.param_groups] == groups_before
    train_step(model, opt, 2)  # still usable


@pytest.mark.parametrize(("key", "value", "match"), [
    ("step", torch.tensor(-1.0), "step"),
    ("step", torch.tensor(float("nan")), "step"),
    ("step", torch.tensor(2.5), "step"),
])
def test_bad_step_counters_are_refused(key, value, match):
    model, opt = _trained("plus")
    state = roundtrip(opt.state_dict())
    state["state"][0][key] = value
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)


# ----------------------------------------------------------------------------------------
# editing param_groups between steps


def test_setting_a_groups_strategy_converts_at_the_next_step():
    model, opt = _trained("bf16")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()}
    opt.param_groups[0]["strategy"] = "plus"
    opt.state_dict()  # converted here already: the saved state is plus's
    for name, p in model.named_parameters():
        state = opt.state[p]
        assert torch.equal(p.detach(), weights[name])
        assert torch.equal(state["weight_lo"], torch.zeros_like(p))  # bf16 -> plus: exact
        assert torch.equal(state["exp_avg_sq"], moments[name])
        assert torch.equal(state["exp_avg_sq_lo"], torch.zeros_like(p))
    train_step(model, opt, 2)
    assert set(opt.state[model.fc1.weight]) == {"step", "exp_avg", "exp_avg_sq",
                                                  "exp_avg_sq_lo", "weight_lo"}


def test_mixed_to_bf16_rounds_the_master_and_frees_the_fp32_tensors():
    model, opt = _trained("mixed")
    masters = {n: opt.state[p]["master"].clone() for n, p in model.named_parameters()}
    opt.param_groups[0]["strategy"] = "bf16"
    opt.state_dict()  # converts, as the next step would
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), masters[name].to(BF16))
        assert "master" not in opt.state[p]
        assert all(v.dtype != torch.float32 for k, v in opt.state[p].items() if k != "step")


def test_a_conversion_that_cannot_be_made_changes_nothing():
    model, opt = _trained("plus")
    before = snapshot(model, opt)
    opt.param_groups[0]["strategy"] = "fp32"  # needs float32 weights
    with pytest.raises(TypeError, match="fp32"):
        train_step(model, opt, 2)
    opt.param_groups[0]["strategy"] = "plus"
    assert_bitwise_equal(before, snapshot(model, opt))


def test_hyperparameters_are_checked_when_they_change():
    model, opt = _trained("plus")
    before = snapshot(model, opt)
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        train_step(model, opt, 2)
    assert_bitwise_equal(before, snapshot(model, opt))


def test_a_group_holding_the_same_immutable_values_is_not_snapshotted(monkeypatch):
    """#31: a group whose keys hold the very immutable objects they held when validated is
    not snapshotted again (``_hyper_key``: a Python call per value, a step's fixed cost);
    a value set anew (an equal one too: snapshotted once, then remembered), a key added,
    or a list edited in place (a mutable value: snapshotted every step) is seen."""
    from collage.optim import admission

    model, opt = _trained("plus")
    snapshots = []
    real = admission._hyper_key
    monkeypatch.setattr(admission, "_hyper_key",
                        lambda group: snapshots.append(1) or real(group))
    group = opt.param_groups[0]
    train_step(model, opt, 2)
    assert snapshots == []
    group["eps"] = float(str(group["eps"]))  # equal, another object
    train_step(model, opt, 3)
    train_step(model, opt, 4)
    assert len(snapshots) == 1
    group["note"] = "a key of the user's"
    train_step(model, opt, 5)
    assert len(snapshots) == 2
    group["betas"] = list(group["betas"])
    train_step(model, opt, 6)
    train_step(model, opt, 7)
    assert len(snapshots) == 4  # one per step: a list can change in place
    group["betas"][1] = 1.5
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        train_step(model, opt, 8)
    assert_bitwise_equal(before, snapshot(model, opt))


def test_a_scheduled_learning_rate_checks_the_settings_not_every_parameter(monkeypatch):
    """#31: a scheduler sets a new learning rate every step. The group's settings are
    validated again (a bad value still refuses the step, nothing changed); its parameters,
    the same ones for the same strategy, are not checked one by one again. A new strategy
    checks every parameter again."""
    from collage.optim import admission

    model, opt = _trained("plus")
    checked = []
    real = admission._check_parameter
    monkeypatch.setattr(admission, "_check_parameter",
                        lambda name, *a, **k: checked.append(name) or real(name, *a, **k))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    for step in range(3):
        train_step(model, opt, 2 + step)
        scheduler.step()
    assert checked == []  # three new learning rates, the parameters not checked again
    opt.param_groups[0]["lr"] = -1.0
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="lr"):
        train_step(model, opt, 6)
    assert_bitwise_equal(before, snapshot(model, opt))
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[0]["strategy"] = "bf16"
    train_step(model, opt, 7)
    # each checked for the new strategy (when it is validated and when states convert)
    assert set(checked) == {name for name, _ in model.named_parameters()}


# ----------------------------------------------------------------------------------------
# torch.optim's keywords; the full-precision state; the clipping proof


def test_torch_keywords_and_positional_order():
    p = [torch.nn.Parameter(torch.zeros(3, dtype=BF16))]
    collage.AdamW(p, 1e-3, (0.9, 0.99), 1e-8, 0.1, False, maximize=False, foreach=None,
                  capturable=False, differentiable=False, fused=None)
    collage.SGD(p, 0.1, 0.9, 0.0, 0.0, True, maximize=False, foreach=None,
                differentiable=False, fused=None)
    for kwargs in ({"amsgrad": True}, {"differentiable": True}):
        with pytest.raises(NotImplementedError, match=next(iter(kwargs))):
            collage.AdamW(p, **kwargs)
    with pytest.raises(ValueError, match="capturable=True"):  # Triton only, no host reads
        collage.AdamW(p, capturable=True, foreach=True)
    with pytest.raises(NotImplementedError, match="differentiable"):
        collage.SGD(p, differentiable=True)


@pytest.mark.parametrize(("change", "error"), [
    (lambda sd: sd.update(extra=torch.zeros(1)), KeyError),
    (lambda sd: sd.update({"fc1.weight": sd["fc1.weight"].long()}), TypeError),
    (lambda sd: sd["fc1.bias"].__setitem__(0, float("nan")), ValueError),
])
def test_load_full_precision_is_strict(change, error):
    model, opt = _trained("plus")
    full = collage.consolidate(model, opt)
    before = snapshot(model, opt)
    change(full)
    with pytest.raises(error):
        collage.load_full_precision(model, opt, full)
    assert_bitwise_equal(before, snapshot(model, opt))


def test_load_full_precision_non_strict_ignores_extra_keys():
    model, opt = _trained("plus")
    full = collage.consolidate(model, opt)
    full["extra"] = torch.zeros(1)
    collage.load_full_precision(model, opt, full, strict=False)


def test_the_clipping_proof_says_what_it_trusts():
    """A write through ``.data`` bumps no version counter: the proof cannot see it, and the
    docstring and docs/reliability.md say so."""
    doc = collage.AdamW.clip_grad_norm_.__doc__
    assert ".data" in doc and "version" in doc
    with open("docs/reliability.md") as handle:
        assert "`.data`" in handle.read()


# ----------------------------------------------------------------------------------------
# random conversions and round trips continue like an uninterrupted run


_TRIPS = ("torch.save", "deepcopy", "pickle", "none")


def _trip(how: str, opt):
    state = opt.state_dict()
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)
    if how == "deepcopy":
        return copy.deepcopy(state)
    if how == "pickle":
        return pickle.loads(pickle.dumps(state))
    return state


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.sampled_from([s for s in ALL_STRATEGIES if s != "fp32"]),
                               st.sampled_from(_TRIPS)), min_size=1, max_size=3))
def test_conversions_and_round_trips_continue_bit_for_bit(plan):
    straight_model, straight = _trained("bf16", steps=1, foreach=True)
    model, opt = _trained("bf16", steps=1, foreach=True)
    step = 1
    for strategy, how in plan:
        straight.param_groups[0]["strategy"] = strategy
        opt.param_groups[0]["strategy"] = strategy
        # state_dict() converts first (the saved state is the saved strategy's), before the
        # next forward pass; the uninterrupted run converts at the same point
        straight.state_dict()
        saved = _trip(how, opt)
        fresh = collage.AdamW(model.named_parameters(), lr=1e-2, strategy=strategy,
                              foreach=True)
        fresh.load_state_dict(saved)
        opt = fresh
        train_step(straight_model, straight, step)
        train_step(model, opt, step)
        step += 1
        assert_bitwise_equal(snapshot(straight_model, straight), snapshot(model, opt))


class _TiedWithBuffers(torch.nn.Module):
    """An embedding tied to its head (GPT-2's wte and lm_head: one parameter, two
    state_dict keys), a BatchNorm (float and integer buffers) and a float64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("exact", torch.tensor([1 + 2.0**-40], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.emb(x)))


def _tied_and_trained() -> tuple[_TiedWithBuffers, collage.AdamW]:
    torch.manual_seed(0)
    model = _TiedWithBuffers().to(BF16)
    model.exact = model.exact.double()  # (.to(BF16) converted it)
    model.exact.fill_(1 + 2.0**-40)
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="plus")
    for _ in range(2):
        model(torch.tensor([0, 3, 5, 1])).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_consolidate_and_load_full_precision_with_tied_weights_and_buffers():
    """The export of a model with a tied weight loads back (each of its names holds its
    value), strict; buffers keep their exact values (float64 stays float64) and the export
    is a copy, not an alias of the model's tensors."""
    model, opt = _tied_and_trained()
    full = collage.consolidate(model, opt)
    assert torch.equal(full["emb.weight"], full["head.weight"])
    assert full["exact"].dtype == torch.float64 and full["exact"].item() == 1 + 2.0**-40
    assert full["bn.running_mean"].data_ptr() != model.bn.running_mean.data_ptr()
    collage.load_full_precision(model, opt, full)
    again = collage.consolidate(model, opt)
    assert all(torch.equal(full[k], again[k]) for k in full)


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda sd: sd.__setitem__("head.weight", sd["head.weight"] + 1), ValueError,
     "one tied parameter"),
    (lambda sd: sd.__setitem__("bn.running_mean", torch.zeros(1)), ValueError,
     "has shape"),
    (lambda sd: sd.pop("bn.running_var"), KeyError, "no value for buffer"),
    (lambda sd: sd.__setitem__("bn.num_batches_tracked", torch.tensor(2.7)), TypeError,
     "would truncate"),
    (lambda sd: sd.__setitem__("emb.weight", sd["emb.weight"].double() * 1e300),
     ValueError, "beyond torch.bfloat16's range"),
])
def test_load_full_precision_checks_tied_names_buffers_and_range_first(change, error,
                                                                       message):
    """Refused before anything is set: a tied weight's names disagreeing, a buffer of
    another shape, a missing buffer (strict), a float into an integer buffer, a finite
    value beyond the weight's format (it would be stored as inf)."""
    model, opt = _tied_and_trained()
    full = collage.consolidate(model, opt)
    full["head.weight"] = full["emb.weight"].clone()
    change(full)
    before = {**snapshot(model, opt), **{k: v.clone() for k, v in model.named_buffers()}}
    with pytest.raises(error, match=message):
        collage.load_full_precision(model, opt, full)
    after = {**snapshot(model, opt), **dict(model.named_buffers())}
    assert_bitwise_equal(before, after)
