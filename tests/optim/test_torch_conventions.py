"""torch.optim's conventions, as its generic optimizer tests check them, for collage's AdamW,
SGD and Lion (issue #30).

PyTorch's ``test/test_optim.py`` runs the same checks over every optimizer: hyperparameters
validated before ``params`` is read, complex and sparse inputs, load/step hooks, parameters
appended to a group, a step without gradients, deterministic state dicts, older state dicts.
They are written here in our own words, over a few strategies. Each passes, or asserts the
difference that docs/reliability.md's drop-in table documents (a refusal, with its
message). The tests named ``test_item<N>_...`` are issue #30's items: each failed on the
code before it.
"""

from __future__ import annotations

import copy
import fractions
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import collage
from collage.optim import get_strategy

from ._common import (
    assert_bitwise_equal,
    bits,
    loss_of,
    make_mlp,
    snapshot,
    train_step,
    weight_dtype,
)

BF16 = torch.bfloat16

#: each rule with small, valid hyperparameters (SGD with momentum: it keeps a state)
RULES = {
    "adamw": (collage.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (collage.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "lion": (collage.Lion, {"lr": 1e-3, "weight_decay": 0.1}),
}
#: a few strategies: float32 weights, a master copy, a pair, stochastic rounding's draws
STRATEGIES = ("fp32", "mixed", "plus", "stochastic")


def _make(rule: str, params, strategy: str = "plus", **extra):
    cls, kwargs = RULES[rule]
    return cls(params, strategy=strategy, **{**kwargs, **extra})


def _param(shape=(4, 3), strategy: str = "plus", seed: int = 0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(shape, generator=gen).to(weight_dtype(strategy)))


def _grad_for(param: torch.Tensor, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(param.shape, generator=gen).to(param.dtype)


def _step(opt, params, step: int) -> None:
    for index, p in enumerate(params):
        p.grad = _grad_for(p, 10 * step + index)
    opt.step()


def _copy(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.detach().clone())


# ----------------------------------------------------------------------------------------
# test_errors: invalid hyperparameters raise before params is read


_INVALID = [
    ("adamw", {"lr": -1e-2}, "lr"),
    ("adamw", {"eps": -1.0}, "eps"),
    ("adamw", {"betas": (1.0, 0.0)}, r"betas\[0\]"),
    ("adamw", {"betas": (0.0, 1.0)}, r"betas\[1\]"),
    ("adamw", {"weight_decay": -1.0}, "weight_decay"),
    ("sgd", {"lr": -1e-2}, "lr"),
    ("sgd", {"momentum": -1.0}, "momentum"),
    ("sgd", {"weight_decay": -1.0}, "weight_decay"),
    ("sgd", {"momentum": 0.0, "nesterov": True}, "nesterov"),
    ("lion", {"lr": -1e-2}, "lr"),
    ("lion", {"betas": (1.5, 0.99)}, r"betas\[0\]"),
    ("lion", {"weight_decay": -1.0}, "weight_decay"),
]


@pytest.mark.parametrize(("rule", "kwargs", "argument"), _INVALID,
                         ids=[f"{r}-{next(iter(k))}-{a}" for r, k, a in _INVALID])
def test_item11_hyperparameters_are_checked_before_params(rule, kwargs, argument):
    """torch.optim validates the hyperparameters first: its test_errors passes
    ``params=None`` with an invalid value and expects the ValueError of that value. Ours
    names the argument (torch's words differ: "Invalid learning rate: -0.01")."""
    with pytest.raises(ValueError, match=argument):
        _make(rule, None, **kwargs)
    with pytest.raises(ValueError, match=argument):  # the same with real parameters
        _make(rule, [_param()], **kwargs)


@pytest.mark.parametrize("rule", RULES)
def test_item11_params_none_names_params(rule):
    with pytest.raises(TypeError, match="params must be an iterable"):
        _make(rule, None)


@pytest.mark.parametrize("rule", RULES)
def test_errors_on_the_params_argument_are_torchs_or_name_the_parameter(rule):
    """A tensor for ``params``, no parameter at all: torch.optim's own checks and messages
    (collage runs them unchanged). A parameter in two groups: torch.optim's check, whose
    message names no parameter, refused with the parameter's names and groups (torch's
    message chained as the cause)."""
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        _make(rule, _param())
    with pytest.raises(ValueError, match="empty parameter list"):
        _make(rule, [])
    shared = _param()
    with pytest.raises(ValueError, match=r"parameter 'group0.param0' is in param group 0 and "
                       r"also in param group 1 \(as 'group1.param1'\)") as refused:
        _make(rule, [{"params": [shared]}, {"params": [_param(seed=1), shared]}])
    assert "more than one parameter group" in str(refused.value.__cause__)
    opt = _make(rule, [{"params": [shared], "param_names": ["head.weight"]}])
    with pytest.raises(ValueError, match=r"'head.weight' is in param group 0 .*'again'"):
        opt.add_param_group({"params": [("again", shared)]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("rule", RULES)
def test_a_parameter_listed_twice_is_refused(rule):
    """Documented difference: torch.optim warns and steps it twice per step."""
    p = _param()
    with pytest.raises(ValueError, match="twice"):
        _make(rule, [p, p])


# ----------------------------------------------------------------------------------------
# deliberate refusals (docs/reliability.md's drop-in table)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", [(5,), (3, 4)], ids=["complex", "complex_2d"])
def test_complex_parameters_are_refused_with_the_way_out(rule, shape):
    """torch.optim steps a complex parameter as its real view (test_complex,
    test_complex_2d); collage refuses it and names torch.view_as_real, which works."""
    z = torch.nn.Parameter(torch.randn(shape, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex.*view_as_real"):
        _make(rule, [z], strategy="fp32")
    real = torch.nn.Parameter(torch.view_as_real(z.detach()).clone())
    opt = _make(rule, [real], strategy="fp32")
    real.grad = torch.ones_like(real)
    before = real.detach().clone()
    opt.step()
    assert not torch.equal(real, before)


def test_sparse_gradients_are_refused_and_nothing_changes():
    """torch.optim.SGD steps a sparse gradient (test_rosenbrock_sparse); collage needs
    dense ones and says so at the step, before anything changes."""
    p = _param((4,), "fp32")
    opt = _make("sgd", [p], strategy="fp32")
    p.grad = torch.sparse_coo_tensor([[0, 2]], [1.0, -1.0], (4,))
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradient.*dense"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


@pytest.mark.parametrize("rule", RULES)
def test_float64_weights_under_fp32_are_refused(rule):
    """torch.optim steps float64 parameters; ``fp32`` stores float32 and refuses them,
    naming the parameter and the fix."""
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="group0.param0.*float64.*float32"):
        _make(rule, [p], strategy="fp32")


# ----------------------------------------------------------------------------------------
# item 8: real numbers of any type, as torch.optim


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["np.float32", "np.float64", "0-d array", "Fraction"])
def test_item8_numpy_and_other_real_hyperparameters_are_accepted(rule, kind):
    """``lr=np.float32(1e-3)`` (and numpy's other scalars, 0-d arrays, Fractions) is a real
    number: accepted, and the step is the step of the same value as a Python float (the
    coefficients are computed in float64 on the host, never in float32)."""
    make = {"np.float32": np.float32, "np.float64": np.float64, "0-d array": np.array,
            "Fraction": fractions.Fraction}[kind]
    values = {"lr": 1e-3, "weight_decay": 0.25}
    if rule != "sgd":
        values["betas"] = (0.8, 0.9)
    else:
        values["momentum"] = 0.7
    odd = {k: tuple(map(make, v)) if k == "betas" else make(v) for k, v in values.items()}
    if kind == "Fraction":  # exact fractions, not the floats' binary values
        odd = {"lr": make(1, 1024), "weight_decay": make(1, 4), "momentum": make(7, 10),
               "betas": (make(4, 5), make(9, 10))}
        odd = {k: v for k, v in odd.items() if k in values}
    as_floats = {k: tuple(map(float, v)) if k == "betas" else float(v) for k, v in odd.items()}
    runs = []
    for kwargs in (odd, as_floats):
        p = _param()
        opt = _make(rule, [p], **kwargs)
        for step in range(3):
            _step(opt, [p], step)
        runs.append(p.detach().clone())
    assert torch.equal(bits(runs[0]), bits(runs[1]))


@pytest.mark.parametrize("value", [True, np.bool_(False), 1j, np.complex64(1), "1e-3",
                                   np.array([1e-3])],
                         ids=["bool", "np.bool_", "complex", "np.complex64", "str", "1-d"])
def test_non_real_learning_rates_are_refused(value):
    with pytest.raises(TypeError, match="lr must be a number"):
        collage.AdamW([_param()], lr=value)


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**64, 2**64 + 5])
def test_a_seed_outside_torchs_range_is_refused(seed):
    """The draws are keyed by 64-bit words: a seed outside torch.manual_seed's range,
    [-2**63, 2**64), would alias one inside (``2**64 + 5`` drawing what 5 draws), so it is
    refused, and a bool is no seed; the range's ends are taken."""
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
        collage.AdamW([_param()], seed=seed)
    with pytest.raises(TypeError, match="seed must be an int, got bool"):
        collage.AdamW([_param()], seed=True)
    for end in (-2**63, 2**64 - 1):
        assert collage.AdamW([_param()], seed=end).seed == end


# ----------------------------------------------------------------------------------------
# item 4: hyperparameters edited in place


@pytest.mark.parametrize("rule", ["adamw", "lion"])
@pytest.mark.parametrize("which", [0, 1])
def test_item4_a_list_betas_edited_in_place_is_validated(rule, which):
    p = _param()
    opt = _make(rule, [p])
    opt.param_groups[0]["betas"] = [0.9, 0.99]  # a list, as a user or a config writes it
    _step(opt, [p], 0)
    before = snapshot_of(opt, p)
    opt.param_groups[0]["betas"][which] = 1.5
    p.grad = _grad_for(p, 1)
    with pytest.raises(ValueError, match=rf"betas\[{which}\] must be in \[0, 1\)"):
        opt.step()
    assert_bitwise_equal(before, snapshot_of(opt, p))
    opt.param_groups[0]["betas"][which] = 0.95  # set right: the step goes on
    opt.step()
    assert float(opt.state[p]["step"]) == 2


@pytest.mark.parametrize("path", [{"foreach": True}, {}, {"reference": True}],
                         ids=["foreach", "default", "reference"])
def test_item4_a_0_d_array_edited_in_place_is_read_at_the_next_step(path):
    """``lr = np.array(1e-2)``, then ``lr[...] = 0`` between steps (the same object, no
    version to bump): the next step reads 0, as torch.optim's does (its weight unchanged),
    and a negative value written so is refused before anything changes."""
    p = _param(strategy="fp32")
    lr = np.array(1e-2)
    opt = collage.AdamW([p], lr=lr, weight_decay=0.1, strategy="fp32", **path)
    _step(opt, [p], 0)
    lr[...] = 0.0
    before = p.detach().clone()
    _step(opt, [p], 1)
    assert torch.equal(bits(p.detach()), bits(before))
    lr[...] = -1.0
    kept = snapshot_of(opt, p)
    p.grad = _grad_for(p, 2)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.step()
    assert_bitwise_equal(kept, snapshot_of(opt, p))


def snapshot_of(opt, p) -> dict[str, torch.Tensor]:
    out = {"param": p.detach().clone()}
    out.update({k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
    return out


# ----------------------------------------------------------------------------------------
# item 2: parameters appended to a group's list


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
def test_item2_a_parameter_appended_to_a_group_is_stepped(rule, named):
    """``param_groups[0]["params"].append(p)`` after a step: torch.optim steps ``p`` from
    the next step on, and so does collage, exactly as an optimizer made with it would."""
    model = torch.nn.Linear(3, 2).to(BF16)
    opt = _make(rule, model.named_parameters() if named else model.parameters())
    params = list(model.parameters())
    _step(opt, params, 0)
    new = _param((5,), seed=7)
    alone = _copy(new)
    opt.param_groups[0]["params"].append(new)
    twin = _make(rule, [alone])
    for step in (1, 2):
        _step(opt, [*params, new], step)
        alone.grad = new.grad.clone()
        twin.step()
    assert torch.equal(bits(new.detach()), bits(alone.detach()))
    assert float(opt.state[new]["step"]) == 2


def test_item2_an_appended_parameter_of_a_named_group_has_a_derived_name():
    """Its name (in errors and metrics) is ``group<i>.param<j>``, as unnamed parameters'."""
    model = torch.nn.Linear(3, 2).to(BF16)
    opt = collage.AdamW(model.named_parameters(), nonfinite="raise")
    new = _param((5,))
    opt.param_groups[0]["params"].append(new)
    for p in [*model.parameters(), new]:
        p.grad = torch.zeros_like(p)
    new.grad[0] = float("nan")
    with pytest.raises(FloatingPointError, match="'group0.param2'"):
        opt.step()


@pytest.mark.parametrize("bad", ["float32 weight", "in another group", "non-leaf"])
def test_item2_an_appended_parameter_is_checked_as_add_param_group_checks(bad):
    """Checked at the next step, naming it, before anything changes."""
    first, second = _param(seed=0), _param(seed=1)
    opt = collage.AdamW([{"params": [first]}, {"params": [second]}], strategy="plus")
    _step(opt, [first, second], 0)
    before = snapshot(torch.nn.ParameterList([first, second]), opt)
    if bad == "float32 weight":
        new, error, match = torch.nn.Parameter(torch.ones(3)), TypeError, "group0.param1"
    elif bad == "in another group":
        new, error, match = second, ValueError, "param group 0 and also in param group 1"
    else:
        leaf = _param()
        new, error, match = leaf * 2, ValueError, "'group0.param1' is not a leaf"
    opt.param_groups[0]["params"].append(new)
    for p in (first, second):
        p.grad = torch.ones_like(p)
    with pytest.raises(error, match=match):
        opt.step()
    opt.param_groups[0]["params"].pop()
    assert_bitwise_equal(before, snapshot(torch.nn.ParameterList([first, second]), opt))


def test_item2_an_appended_parameter_moves_no_other_draws():
    """The stochastic-rounding draws are keyed by each parameter's position: a parameter
    appended to the first group takes a new position, so the second group's parameters
    round exactly as without it."""
    runs = []
    for append in (False, True):
        a, b = _param(seed=0), _param(seed=1)
        opt = collage.AdamW([{"params": [a]}, {"params": [b]}], strategy="stochastic",
                            lr=1e-2)
        _step(opt, [a, b], 0)
        stepped = [a, b]
        if append:
            stepped.append(_param(seed=2))
            opt.param_groups[0]["params"].append(stepped[-1])
        for step in (1, 2, 3):
            _step(opt, stepped, step)
        assert float(opt.state[stepped[-1]]["step"]) == (3 if append else 4)
        runs.append(b.detach().clone())
    assert torch.equal(bits(runs[0]), bits(runs[1]))


def test_item2_a_parameter_removed_from_a_named_group_keeps_its_name_or_says_so():
    """Removing a parameter from a named group's ``params`` but not its name from
    ``param_names`` leaves the names ambiguous: a clear error, not wrong names."""
    model = torch.nn.Linear(3, 2).to(BF16)
    opt = collage.AdamW(model.named_parameters())
    opt.param_groups[0]["params"].pop()
    model.weight.grad = torch.ones_like(model.weight)
    with pytest.raises(ValueError, match="param_names"):
        opt.step()
    opt.param_groups[0]["param_names"].pop()
    opt.step()
    assert float(opt.state[model.weight]["step"]) == 1


# ----------------------------------------------------------------------------------------
# item 6: groups removed, reordered, inserted


def _two_groups(strategies=("plus", "mixed")):
    a, b = _param(seed=0), _param(seed=1)
    opt = collage.AdamW([{"params": [a], "strategy": strategies[0]},
                         {"params": [b], "strategy": strategies[1]}], lr=1e-2)
    return a, b, opt


def test_item6_a_group_popped_leaves_the_others_as_they_were():
    """Bookkeeping follows the group, not its index: after ``param_groups.pop(0)`` the
    remaining (``mixed``) group steps as an optimizer of it alone (its states are not
    'converted' from the popped group's strategy)."""
    a, b, opt = _two_groups()
    alone = _copy(b)
    twin = collage.AdamW([alone], lr=1e-2, strategy="mixed")
    _step(opt, [a, b], 0)
    alone.grad = b.grad.clone()
    twin.step()
    opt.param_groups.pop(0)
    assert opt.last_paths.keys() == {0}
    for step in (1, 2):
        _step(opt, [b], step)
        alone.grad = b.grad.clone()
        twin.step()
    assert torch.equal(bits(b.detach()), bits(alone.detach()))
    assert opt.state[b]["master"].dtype == torch.float32


@pytest.mark.parametrize("change", ["reversed", "inserted ahead", "first removed"])
def test_item6_groups_reordered_inserted_or_removed_step_as_before(change):
    """Each group keeps its strategy and states, each parameter its draws (the second
    group is ``stochastic``): bit for bit the run without the change."""
    runs = []
    for changed in (False, True):
        a, b, opt = _two_groups(("plus", "stochastic"))
        _step(opt, [a, b], 0)
        paths = opt.last_paths
        if changed and change == "reversed":
            opt.param_groups.reverse()
            assert opt.last_paths == {0: paths[1], 1: paths[0]}
        elif changed and change == "inserted ahead":
            opt.add_param_group({"params": [_param(seed=5)], "strategy": "bf16"})
            opt.param_groups.insert(0, opt.param_groups.pop())
            assert opt.last_paths == {1: paths[0], 2: paths[1]}
        elif changed:
            opt.param_groups.pop(0)
            assert opt.last_paths == {0: paths[1]}
        for step in (1, 2):
            _step(opt, [a, b], step)
        runs.append({"b": b.detach().clone()} if change == "first removed"
                    else {"a": a.detach().clone(), "b": b.detach().clone()})
        if not (changed and change == "first removed"):
            groups = {g["strategy"]: g for g in opt.param_groups}
            assert groups["plus"]["params"] == [a] and "weight_lo" in opt.state[a]
    assert_bitwise_equal(*runs)


def test_item6_a_group_inserted_by_hand_gets_the_defaults_and_is_checked():
    p, q = _param(seed=0), _param(seed=1)
    opt = collage.AdamW([p], lr=1e-2, strategy="plus")
    opt.param_groups.insert(0, {"params": [q], "lr": 3e-3})
    _step(opt, [p, q], 0)
    assert opt.param_groups[0]["strategy"] == "plus" and float(opt.state[q]["step"]) == 1
    opt.param_groups.insert(0, {"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(TypeError, match="group0.param0.*float32"):
        opt.step()


# ----------------------------------------------------------------------------------------
# item 7: meta parameters


def _meta_cases():
    for rule in RULES:
        for strategy in collage.STRATEGIES:
            rules = get_strategy(strategy).rules
            if rules is not None and rule not in rules:
                continue
            yield rule, strategy


@pytest.mark.parametrize(("rule", "strategy"), list(_meta_cases()))
@pytest.mark.parametrize("path", [{}, {"foreach": True}, {"foreach": False},
                                  {"reference": True}],
                         ids=["default", "foreach", "per_tensor", "reference"])
def test_item7_meta_parameters_step(rule, strategy, path):
    """torch.optim steps parameters on the ``meta`` device (no values: a no-op in effect,
    used to trace memory and shapes); collage too: the states are made on ``meta`` and
    nothing is read back."""
    p = torch.nn.Parameter(torch.empty(70, 3, dtype=weight_dtype(strategy), device="meta"))
    opt = _make(rule, [p], strategy, **path)
    for _ in range(2):
        p.grad = torch.empty_like(p)
        opt.step()
    state = opt.state[p]
    assert float(state["step"]) == 2
    assert all(v.device.type == "meta" for k, v in state.items() if k != "step")


@pytest.mark.parametrize("rule", RULES)
def test_item7_a_meta_optimizer_saves_loads_and_steps_on(rule):
    """A state dict of meta parameters loads into an optimizer of meta parameters, which
    steps on (the step counters stay on the host, where a new state keeps them)."""
    p = torch.nn.Parameter(torch.empty(4, dtype=BF16, device="meta"))
    opt = _make(rule, [p])
    p.grad = torch.empty_like(p)
    opt.step()
    q = torch.nn.Parameter(torch.empty(4, dtype=BF16, device="meta"))
    other = _make(rule, [q])
    other.load_state_dict(opt.state_dict())
    assert other.state[q]["step"].device.type == "cpu"
    q.grad = torch.empty_like(q)
    other.step()
    assert float(other.state[q]["step"]) == 2


@pytest.mark.parametrize("rule", ["adamw", "sgd"])
def test_item7_meta_parameters_step_with_fused(rule):
    p = torch.nn.Parameter(torch.empty(8, dtype=BF16, device="meta"))
    opt = _make(rule, [p], "plus", fused=True)
    p.grad = torch.empty_like(p)
    opt.step()
    assert opt.state[p]["exp_avg" if rule == "adamw" else "momentum_buffer"].is_meta


# ----------------------------------------------------------------------------------------
# steps that change nothing; zero_grad


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_step_is_noop_when_params_have_no_grad(rule, strategy):
    p = _param(strategy=strategy)
    opt = _make(rule, [p], strategy)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(bits(p.detach()), bits(before)) and not opt.state.get(p)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("maximize", [False, True])
def test_step_is_noop_for_zero_grads(rule, strategy, maximize):
    """No weight decay and zero gradients: the update is zero, the weight stays, bit for
    bit (every compensation term included)."""
    p = _param(strategy=strategy)
    opt = _make(rule, [p], strategy, weight_decay=0.0, maximize=maximize)
    before = p.detach().clone()
    for _ in range(2):
        p.grad = torch.zeros_like(p)
        opt.step()
    assert torch.equal(bits(p.detach()), bits(before))


@pytest.mark.parametrize("rule", RULES)
def test_zero_grad_sets_to_none_by_default(rule):
    p = _param()
    opt = _make(rule, [p])
    p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and not p.grad.any()
    opt.zero_grad()
    assert p.grad is None


# ----------------------------------------------------------------------------------------
# step hooks


@pytest.mark.parametrize("rule", RULES)
def test_step_pre_and_post_hooks_run_around_each_step(rule):
    p = _param()
    opt = _make(rule, [p])
    seen = []

    def pre(optimizer, args, kwargs):
        seen.append(("pre", float(optimizer.state[p]["step"]) if optimizer.state.get(p)
                     else 0.0))

    def post(optimizer, args, kwargs):
        seen.append(("post", float(optimizer.state[p]["step"])))

    pre_handle = opt.register_step_pre_hook(pre)
    post_handle = opt.register_step_post_hook(post)
    for step in range(2):
        _step(opt, [p], step)
    assert seen == [("pre", 0.0), ("post", 1.0), ("pre", 1.0), ("post", 2.0)]
    pre_handle.remove()
    post_handle.remove()
    _step(opt, [p], 2)
    assert len(seen) == 4


# ----------------------------------------------------------------------------------------
# item 9: load_state_dict hooks


def _trained(rule: str, strategy: str = "plus"):
    p = _param(strategy=strategy)
    opt = _make(rule, [p], strategy)
    for step in range(2):
        _step(opt, [p], step)
    return p, opt


def _pre_hook_sets_lr(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def _pre_hook_returns_a_copy(optimizer, state_dict):
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _post_hook_marks(optimizer):
    optimizer.state["ran_pre_hook_returning_a_copy"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_post_hook"] = True


@pytest.mark.parametrize("rule", RULES)
def test_item9_load_state_dict_post_hook(rule):
    """torch's test_load_state_dict_post_hook: what the post-hook writes into the state
    stays (collage's loader installed its states after the hooks ran)."""
    p, opt = _trained(rule)
    opt.register_load_state_dict_post_hook(_post_hook_marks)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_pre_hook_returning_a_copy"] is False
    assert opt.state["ran_post_hook"] is True
    assert float(opt.state[p]["step"]) == 2


@pytest.mark.parametrize("rule", RULES)
def test_item9_load_state_dict_pre_post_hook(rule):
    """torch's test_load_state_dict_pre_post_hook: a pre-hook's returned state dict is
    the one loaded, and the post-hook sees it; and with prepend, the later hook wins."""
    p, opt = _trained(rule)
    opt.register_load_state_dict_pre_hook(_pre_hook_returns_a_copy)
    opt.register_load_state_dict_post_hook(_post_hook_marks)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_pre_hook_returning_a_copy"] is True
    assert opt.state["ran_post_hook"] is True
    assert float(opt.state[p]["step"]) == 2

    _, fresh = _trained(rule)
    fresh.register_load_state_dict_pre_hook(_pre_hook_sets_lr)
    fresh.load_state_dict(fresh.state_dict())
    assert fresh.param_groups[0]["lr"] == 0.002
    fresh.register_load_state_dict_pre_hook(_pre_hook_returns_a_copy, prepend=True)
    fresh.load_state_dict(fresh.state_dict())
    assert fresh.param_groups[0]["lr"] == 0.002  # the copy's 0.003, then set by the other


@pytest.mark.parametrize("rule", RULES)
def test_item9_hooks_see_and_change_the_whole_state(rule):
    """The pre-hook sees every parameter's state and may change it (what is loaded is what
    it left); the post-hook sees the installed states and its change stays."""
    p, opt = _trained(rule)
    key = "exp_avg" if rule != "sgd" else "momentum_buffer"
    seen = {}

    def pre(optimizer, state_dict):
        seen["pre"] = sorted(state_dict["state"][0])
        state_dict["state"][0][key] = torch.full_like(state_dict["state"][0][key], 0.5)

    def post(optimizer):
        seen["post"] = float(optimizer.state[p][key][0, 0])
        optimizer.state[p]["step"].fill_(7.0)

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(opt.state_dict())
    assert "step" in seen["pre"] and key in seen["pre"]
    assert seen["post"] == 0.5 and bool((opt.state[p][key] == 0.5).all())
    assert float(opt.state[p]["step"]) == 7.0


@pytest.mark.parametrize("rule", RULES)
def test_state_dict_post_hooks_see_and_shape_the_finished_dict(rule):
    """As torch.optim's: the state-dict post-hooks run last, on the dict as it will be
    returned (collage's own ``"collage"`` entry included), and what a hook returns is what
    ``state_dict()`` returns. They used to run inside torch's part, before collage added its
    entry, so a hook could not remove it and a hook that wrapped the dict made
    ``state_dict()`` fail with a bare KeyError (found by audit, 2026-12-07)."""
    _, opt = _trained(rule)
    seen = {}

    def strip(optimizer, state_dict):
        seen["keys"] = sorted(state_dict)
        return {k: state_dict[k] for k in ("state", "param_groups")}

    handle = opt.register_state_dict_post_hook(strip)
    assert sorted(opt.state_dict()) == ["param_groups", "state"]
    assert seen["keys"] == ["collage", "param_groups", "state"]
    handle.remove()
    opt.register_state_dict_post_hook(lambda optimizer, sd: {"optimizer": sd, "format": 2})
    wrapped = opt.state_dict()
    assert wrapped["format"] == 2 and "collage" in wrapped["optimizer"]
    fresh = _make(rule, [_param(seed=1)])
    fresh.load_state_dict(wrapped["optimizer"])  # the wrapped dict is the complete one
    assert fresh.state_dict()["collage"] == wrapped["optimizer"]["collage"]


# ----------------------------------------------------------------------------------------
# state dicts: deterministic, older, incomplete (item 10)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_deterministic(rule, strategy):
    """A state dict loaded into a fresh optimizer (over copies of the weights) continues
    bit for bit; its state_dict is the original's; saving does not change the state."""
    p = _param(strategy=strategy)
    opt = _make(rule, [p], strategy)
    for step in range(2):
        _step(opt, [p], step)
    saved = opt.state_dict()
    assert_equal_state_dicts(saved, opt.state_dict())
    q = _copy(p)
    other = _make(rule, [q], strategy)
    other.load_state_dict(copy.deepcopy(saved))
    assert_equal_state_dicts(saved, other.state_dict())
    for step in (2, 3):
        _step(opt, [p], step)
        _step(other, [q], step)
    assert torch.equal(bits(p.detach()), bits(q.detach()))
    assert_equal_state_dicts(opt.state_dict(), other.state_dict())


def assert_equal_state_dicts(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a.get("collage") == b.get("collage")
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(bits(value), bits(b["state"][index][key])), (index, key)


@pytest.mark.parametrize("rule", RULES)
def test_can_load_older_state_dict(rule):
    """A state dict saved before some flags existed (their keys missing from the groups)
    and without collage's extra entry (as torch.distributed.checkpoint keeps it) loads,
    the missing values taken from the optimizer, and continues as the original."""
    p, opt = _trained(rule)
    saved = copy.deepcopy(opt.state_dict())
    del saved["collage"]
    for group in saved["param_groups"]:
        for key in ("foreach", "fused", "maximize", "capturable", "differentiable"):
            group.pop(key, None)
    q = _copy(p)
    other = _make(rule, [q])
    other.load_state_dict(saved)
    assert other.param_groups[0]["maximize"] is False
    _step(opt, [p], 5)
    _step(other, [q], 5)
    assert torch.equal(bits(p.detach()), bits(q.detach()))


@pytest.mark.parametrize("rule", RULES)
def test_item10_a_state_without_its_step_is_refused(rule):
    p, opt = _trained(rule)
    saved = copy.deepcopy(opt.state_dict())
    del saved["state"][0]["step"]
    before = snapshot_of(opt, p)
    with pytest.raises(ValueError, match="'group0.param0' has no 'step' key"):
        opt.load_state_dict(saved)
    assert_bitwise_equal(before, snapshot_of(opt, p))


# ----------------------------------------------------------------------------------------
# copies keep what the books hold


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_after_group_changes_continues_bit_for_bit(how):
    """After a parameter appended and a group reordered, a copy of the model and the
    optimizer together continues exactly as the original (the draws' positions and each
    group's strategy travel with it)."""
    model = make_mlp(BF16)
    params = list(model.parameters())
    opt = collage.AdamW([{"params": params[:2], "strategy": "stochastic"},
                         {"params": params[2:], "strategy": "plus"}], lr=1e-2)
    train_step(model, opt, 0)
    extra = _param((3,), seed=3)
    model.register_parameter("extra", extra)
    opt.param_groups[1]["params"].append(extra)
    opt.param_groups.reverse()
    pair = (model, opt)
    model2, opt2 = (copy.deepcopy(pair) if how == "deepcopy"
                    else pickle.loads(pickle.dumps(pair)))
    for step in (1, 2):
        grad = _grad_for(extra, step)
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad(set_to_none=True)
            loss_of(m, step).backward()
            m.extra.grad = grad.clone()
            o.step()
    assert_bitwise_equal(snapshot(model, opt), snapshot(model2, opt2))
    assert opt2.last_paths == opt.last_paths == {0: "native", 1: "native"}


@pytest.mark.parametrize("rule", RULES)
def test_global_step_hooks_run_for_collage_optimizers(rule):
    """torch.optim's global hooks (``register_optimizer_step_pre_hook`` / ``post_hook``)
    see collage's steps too."""
    p = _param()
    opt = _make(rule, [p])
    seen = []
    pre = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append(("pre", optimizer is opt)))
    post = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: seen.append(("post", optimizer is opt)))
    try:
        _step(opt, [p], 0)
    finally:
        pre.remove()
        post.remove()
    assert seen == [("pre", True), ("post", True)]


def test_step_hooks_follow_torchs_order_and_contract():
    """The step's own wrapper (``step_hooks.optimizer_step``, which replaces torch's
    ``profile_hook_step``) keeps torch's order (global pre, own pre, the step, own post,
    global post), lets a pre-hook replace the step's arguments (here: a closure, whose
    loss the step returns), passes the replaced arguments to the post-hooks, and
    refuses a pre-hook's other results with torch's message. Torch wraps it no further:
    one pre-hook call a step."""
    p = _param()
    opt = _make("adamw", [p])
    seen = []

    def closure():
        seen.append("closure")
        return torch.tensor(3.0)

    def own_pre(optimizer, args, kwargs):
        seen.append("own pre")
        return (args[0],), {"closure": closure}

    pre = register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global pre"))
    post = register_optimizer_step_post_hook(
        lambda o, a, k: seen.append(("global post", k.get("closure") is closure)))
    handles = [opt.register_step_pre_hook(own_pre),
               opt.register_step_post_hook(lambda o, a, k: seen.append("own post"))]
    try:
        p.grad = torch.ones_like(p)
        loss = opt.step()
    finally:
        pre.remove()
        post.remove()
    assert float(loss) == 3.0
    assert seen == ["global pre", "own pre", "closure", "own post", ("global post", True)]
    handles[0].remove()
    opt.register_step_pre_hook(lambda o, a, k: "not a pair")
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="must return None or a tuple of"):
        opt.step()
    assert torch.equal(bits(p.detach()), bits(before))


@pytest.mark.parametrize("rule", RULES)
def test_the_profiler_records_each_step_under_torchs_name(rule, monkeypatch):
    """Where a profiler runs, each step and ``zero_grad`` is recorded as torch names it
    (``Optimizer.step#<class>.step``, ``Optimizer.zero_grad#<class>.zero_grad``); where
    none runs, no record is entered (13 us each)."""
    p = _param()
    opt = _make(rule, [p])
    entered = []
    original = torch.autograd.profiler.record_function

    def counted(name, *args):
        entered.append(name)
        return original(name, *args)

    with monkeypatch.context() as patched:
        patched.setattr(torch.autograd.profiler, "record_function", counted)
        for step in range(2):
            _step(opt, [p], step)
            opt.zero_grad()
            assert p.grad is None
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(2, 4):
            _step(opt, [p], step)
            opt.zero_grad()
            assert p.grad is None
    names = [f"Optimizer.{method}#{type(opt).__name__}.{method}"
             for method in ("step", "zero_grad")]
    assert [[e.count for e in prof.key_averages() if e.key == name] for name in names] == [
        [2], [2]]


@pytest.mark.parametrize("rule", RULES)
def test_deepcopy_copies_all_public_attributes(rule):
    p, opt = _trained(rule)
    copied = copy.deepcopy(opt)
    public = [name for name in dir(opt) if not name.startswith("_")
              and not callable(getattr(opt, name))]
    assert {"defaults", "param_groups", "state", "last_paths", "seed"} <= set(public)
    for name in public:
        if name in ("state", "param_groups"):
            continue  # tensors: compared below
        assert getattr(copied, name) == getattr(opt, name), name
    assert_equal_state_dicts(opt.state_dict(), copied.state_dict())


@pytest.mark.parametrize("rule", RULES)
def test_optimizer_can_be_printed(rule):
    text = repr(_make(rule, [_param()]))
    assert text.startswith(RULES[rule][0].__name__) and "strategy: plus" in text


def test_importing_collage_does_not_import_dynamo():
    """The CLI (and with it every optimizer module) imports without torch._dynamo: the
    step's wrapper and the autograd hooks are kept from dynamo as torch.optim's methods are
    (``step_hooks.never_traced``: dynamo imported at their first call). With
    ``torch.compiler.disable``, which imports it where it is applied, every ``collage``
    command took 1.3 s more to start (3.7 s against torch's 2.1, a 2-vCPU AMD EPYC).
    That the step is still never traced: tests/integrations/test_compile.py."""
    code = "import sys, collage.cli; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
