"""The native plan (``collage.optim.native_plan``): a group's later steps reuse its pointer
table after cheap checks. Its steps must be the general native path's bits (the twin
optimizer below runs with plans off), and every change the checks exist for must be noticed:
the step then takes the general path, and no stale pointer is written (the replaced tensors
keep their bits)."""

from __future__ import annotations

import copy
from array import array

import pytest
import torch

import collage
from collage.optim import native
from collage.optim.draws import MIX_START, mix_state, stochastic_key
from collage.optim.native import plan as native_plan
from collage.optim.native.plan import NativePlan

from ._common import bits

pytestmark = pytest.mark.skipif(
    not native.available() or not native.loaded().collage_native_openmp(),
    reason="plans need the native kernels built with OpenMP")

STRATEGIES = ("fp32", "mixed", "bf16", "kahan", "stochastic", "light", "plus", "split")
# a vector, a matrix, one tensor above 2 x 65,536 elements (two threads cut it)
SHAPES = ((7,), (33, 5), (300, 500))
STEPS = 5
# NativePlan.build as defined, and one that never makes a plan (plans switched off)
_BUILD = NativePlan.__dict__["build"]
_NO_PLAN = classmethod(lambda cls, group, entries: None)


def _model(strategy: str, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in SHAPES]


def _grads(params, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for p in params]


def _optimizer(strategy: str, params) -> collage.AdamW:
    groups = [{"params": params[:2], "weight_decay": 0.0},
              {"params": params[2:], "weight_decay": 0.1, "betas": (0.8, 0.95)}]
    return collage.AdamW(groups, lr=1e-2, strategy=strategy, nonfinite="ignore")


class _PlanSteps:
    """Counts the groups' steps plans took (``native_plan.step_plans``, through which a
    step of every group by its plan and ``NativePlan.step`` of one both go; the general
    path's steps are not counted)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = native_plan.step_plans

        def counted(runs, check):
            done = original(runs, check)
            self.count += len(runs) if done else 0
            return done

        monkeypatch.setattr(native_plan, "step_plans", counted)


def _train(strategy: str, plans: bool, monkeypatch, change=None):
    """STEPS steps with a new learning rate each; ``change(opt, params, step)`` runs before
    step 3 and may return tensors that must not change afterwards."""
    # plans off: none is ever built, so every step takes the general path
    monkeypatch.setattr(NativePlan, "build", _BUILD if plans else _NO_PLAN)
    params = _model(strategy)
    opt = _optimizer(strategy, params)
    frozen = []
    for step in range(STEPS):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        if change is not None and step == 3:
            kept = change(opt, params) or []
            frozen = [(t, t.clone()) for t in kept]
        opt.step()
        assert set(opt.last_paths.values()) == {"native"}
        for group in opt.param_groups:
            group["lr"] *= 0.7
    for old, snapshot in frozen:  # the plan never wrote through a stale pointer
        assert torch.equal(bits(old), bits(snapshot))
    return params, opt


def _assert_same(params, opt, twin_params, twin_opt) -> None:
    for p, q in zip(params, twin_params):
        assert torch.equal(bits(p.detach()), bits(q.detach()))
        state, twin_state = opt.state[p], twin_opt.state[q]
        assert state.keys() == twin_state.keys()
        for key in state:
            assert torch.equal(bits(state[key]), bits(twin_state[key])), key


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_steps_are_the_general_paths_bits(strategy: str, monkeypatch) -> None:
    plan_steps = _PlanSteps(monkeypatch)
    twin = _train(strategy, False, monkeypatch)
    assert plan_steps.count == 0
    params, opt = _train(strategy, True, monkeypatch)
    assert plan_steps.count == 2 * (STEPS - 1)  # two groups, every step after the first
    _assert_same(params, opt, *twin)
    assert all(float(opt.state[p]["step"]) == STEPS for p in params)


def _replace_weight(opt, params):
    old = params[2].data
    params[2].data = old.clone()
    return [old]


def _replace_state_tensor(opt, params):
    state = opt.state[params[2]]
    old = state["exp_avg"]
    state["exp_avg"] = old.clone()
    return [old]


def _change_step_counter(opt, params):
    opt.state[params[0]]["step"].fill_(10.0)  # checked in C before anything is written


def _load_state_dict(opt, params):
    old = [t for p in params for t in opt.state[p].values()]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return old


def _drop_a_gradient(opt, params):
    params[1].grad = None


def _non_contiguous_gradient(opt, params):
    params[1].grad = params[1].grad.t().contiguous().t()


CHANGES = {"weight replaced": _replace_weight, "state tensor replaced": _replace_state_tensor,
           "step counter changed": _change_step_counter, "load_state_dict": _load_state_dict,
           "gradient missing": _drop_a_gradient,
           "non-contiguous gradient": _non_contiguous_gradient}


@pytest.mark.parametrize("change", CHANGES, ids=str)
@pytest.mark.parametrize("strategy", ("stochastic", "plus"))
def test_plan_notices_what_changed(strategy: str, change: str, monkeypatch) -> None:
    plan_steps = _PlanSteps(monkeypatch)
    twin = _train(strategy, False, monkeypatch, CHANGES[change])
    params, opt = _train(strategy, True, monkeypatch, CHANGES[change])
    _assert_same(params, opt, *twin)
    # steps 1-2 of both groups ran by plan; step 3 of the changed group did not; step 4
    # ran by a rebuilt plan where the general path of step 3 could build one
    assert 5 <= plan_steps.count <= 7


#: a weight given a new view of its own memory: the same address, another dtype or shape
SAME_ADDRESS_VIEWS = {"float16 view": lambda w: w.view(torch.float16),
                      "narrower view": lambda w: w[:16], "flattened view": lambda w: w.view(-1)}


@pytest.mark.parametrize("view", SAME_ADDRESS_VIEWS, ids=str)
@pytest.mark.parametrize("plans", [True, False], ids=["planned", "general"])
def test_a_weight_viewed_anew_at_its_address_is_refused_as_the_general_path_refuses(
        view: str, plans: bool, monkeypatch) -> None:
    """``p.data = p.data.view(torch.float16)`` (or a narrower or reshaped view) keeps the
    weight's address, and its old gradient stays: the general path refuses the step (the
    gradient no longer matches the weight), and so must a plan, whose pointer checks all
    pass; nothing is written either way."""
    monkeypatch.setattr(NativePlan, "build", _BUILD if plans else _NO_PLAN)
    params = _model("plus")
    opt = _optimizer("plus", params)
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    weight = params[1]
    address = weight.data_ptr()
    weight.data = SAME_ADDRESS_VIEWS[view](weight.data)
    assert weight.data_ptr() == address
    for p, g in zip(params, _grads(params, 3)):
        if p is not weight:  # the re-viewed weight keeps its old gradient
            p.grad = g
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for p in params]
    with pytest.raises((TypeError, ValueError), match="the gradient of parameter"):
        opt.step()
    for p, (w, state) in zip(params, before):
        assert torch.equal(bits(p.detach()), bits(w))
        for key, value in state.items():
            assert torch.equal(bits(opt.state[p][key]), bits(value)), key


def test_counters_at_the_float32_limit_take_the_general_path(monkeypatch) -> None:
    """float32 counters count exactly up to 2**24 (torch's stop there: + 1 rounds back):
    plans step while the next count is exact, the general path after."""
    plan_steps = _PlanSteps(monkeypatch)
    params = _model("light")
    opt = _optimizer("light", params)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    for p in params:
        opt.state[p]["step"].fill_(2.0**24 - 2)
    opt.step()  # the plan sees changed counters: the general path, to 2**24 - 1, a plan
    assert plan_steps.count == 0
    opt.step()  # the plan: to 2**24
    assert plan_steps.count == 2  # both groups
    opt.step()  # past the exact range: the general path (2**24 + 1 rounds to 2**24)
    opt.step()
    assert plan_steps.count == 2
    assert all(float(opt.state[p]["step"]) == 2.0**24 for p in params)


def test_load_state_dict_drops_the_plans(monkeypatch) -> None:
    """A plan holds its group's state dicts: loading drops it, so the old state tensors are
    freed at once, not at the group's next step."""
    import gc
    import weakref

    params, opt = _train("plus", True, monkeypatch)
    assert any("native_plan" in book.cache for book in opt._books.values())
    old = weakref.ref(opt.state[params[0]]["exp_avg"])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()
    assert old() is None


def test_keys_mixed_in_c_are_the_python_keys() -> None:
    """``collage_stochastic_keys`` (the step mixed into a kept ``base._mix`` state) equals
    ``fused.stochastic_key`` for seeds of every sign and size the optimizer takes
    (``admission.SEEDS``: both its ends), positions and steps up to the plans' limit:
    integer arithmetic, compared exactly."""
    lib = native.loaded()
    for seed in (0, 1, -1, 2**31, -(2**40) + 3, 2**64 - 1, -2**63):
        opt = collage.AdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
                             for _ in range(3)], strategy="stochastic", seed=seed)
        params = [p for g in opt.param_groups for p in g["params"]]
        for step in (1, 2, 3, 1000, 2**24 - 1, 2**24):
            states = array("Q", [mix_state(MIX_START, seed, i) for i in range(len(params))])
            table = array("q", [0] * (native.TABLE_COLUMNS * len(params)))
            lib.collage_stochastic_keys(len(params), table.buffer_info()[0],
                                        states.buffer_info()[0], step)
            for row, p in enumerate(params):
                got = (table[row * native.TABLE_COLUMNS + native.COLUMN_KEY0],
                       table[row * native.TABLE_COLUMNS + native.COLUMN_KEY1])
                position = opt._parameter_positions()[id(p)]
                assert got == stochastic_key(opt.seed, position, step), (seed, row, step)


def _new_seed(opt, params):
    opt.seed = 1234


def _new_group(opt, params):
    # appended: positions count in group order, so the others' keys do not move
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]})


def _moved(opt, params):
    # Nothing public moves a position since #30 (a parameter inserted or appended takes
    # the next one); swapped by hand, the plan must still notice the keys of the first
    # group's rows moved (that group takes the general path once, the other does not)
    positions = opt._positions
    first, second = (id(p) for p in opt.param_groups[0]["params"][:2])
    positions[first], positions[second] = positions[second], positions[first]


@pytest.mark.parametrize(("change", "planned"), [(_new_seed, (4, 6)), (_moved, (7, 7)),
                                                 (_new_group, (8, 8))],
                         ids=["seed", "moved positions", "param group"])
def test_stochastic_plan_notices_a_new_seed_or_parameter_order(change, planned,
                                                               monkeypatch) -> None:
    """Its keys come from states kept per row (seed and position mixed in once): a new
    ``seed`` or moved positions take the general path, which keys the draws anew; a group
    appended after the others moves no key, and the plans go on."""
    plan_steps = _PlanSteps(monkeypatch)
    twin = _train("stochastic", False, monkeypatch, change)
    params, opt = _train("stochastic", True, monkeypatch, change)
    _assert_same(params, opt, *twin)
    assert planned[0] <= plan_steps.count <= planned[1]


#: a path flag set on a group after its native steps, and the path it then chooses
FLAG_CHANGES = [({"foreach": True}, "foreach"), ({"foreach": False}, "per_tensor"),
                ({"fused": False}, "foreach"), ({"reference": True}, "reference")]


@pytest.mark.parametrize(("flags", "path"), FLAG_CHANGES, ids=str)
def test_a_flag_set_mid_run_leaves_the_plan(flags: dict, path: str) -> None:
    """Issue #30, item 3: a group's ``foreach``, ``fused`` or ``reference`` set after its
    steps chooses the path again (the plan was kept: ``last_paths`` said 'native'); the step
    is that path's, bit for bit a twin's whose plan was dropped before the same change."""
    runs = []
    for drop_plans in (False, True):
        params = _model("plus")
        opt = collage.AdamW(params, lr=1e-2, strategy="plus", nonfinite="ignore")
        for step in range(3):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
            if step == 2:
                if drop_plans:
                    for book in opt._books.values():
                        book.cache.clear()
                opt.param_groups[0].update(flags)
            opt.step()
            assert opt.last_paths == {0: "native" if step < 2 else path}
        runs.append((params, opt))
    _assert_same(*runs[0], *runs[1])


@pytest.mark.parametrize(("where", "value"), [(0, float("nan")), (2, float("inf")),
                                              (2, float("-inf")), (None, None)])
@pytest.mark.parametrize("strategy", ["bf16", "plus", "fp32"])
def test_the_default_check_of_planned_groups_reads_their_tables(strategy, where, value,
                                                               monkeypatch) -> None:
    """#31: where every group of a step has its plan ready, one C call checks and steps
    them all (``step_plans`` with ``check``), not the gradient lists' check
    (``nonfinite.nonfinite_flag``) nor a plan's step of one group (``NativePlan.step``), both
    refused here: a non-finite element in any group's last element (tensor ``where``; the
    tensor of group 1 is cut between two threads, so the thread that finds it is not the
    one stepping group 0) skips the whole step (every weight and state bitwise unchanged,
    one skip counted, the parameter named); finite gradients step as the general path
    does, bit for bit."""
    from collage.optim import nonfinite

    def groups(params):
        return [{"params": params[:2], "weight_decay": 0.0},
                {"params": params[2:], "weight_decay": 0.1}]

    params, twins = _model(strategy), _model(strategy)
    opt = collage.AdamW(groups(params), lr=1e-2, strategy=strategy)
    monkeypatch.setattr(NativePlan, "build", _NO_PLAN)
    ref = collage.AdamW(groups(twins), lr=1e-2, strategy=strategy)
    monkeypatch.setattr(NativePlan, "build", _BUILD)
    for step in range(2):  # the first step makes the plans
        for p, q, g in zip(params, twins, _grads(params, step)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()

    def refused(*args, **kwargs):
        raise AssertionError("a planned step listed its gradients for the check")

    monkeypatch.setattr(nonfinite, "nonfinite_flag", refused)
    monkeypatch.setattr(NativePlan, "step", refused)
    checked = []
    one_call = native_plan.step_plans
    monkeypatch.setattr(native_plan, "step_plans",
                        lambda runs, check: checked.append((len(runs), check))
                        or one_call(runs, check))
    for p, q, g in zip(params, twins, _grads(params, 2)):
        p.grad, q.grad = g, g.clone()
    if where is not None:
        params[where].grad.view(-1)[-1] = value
    before = [bits(p) for p in params], copy.deepcopy(opt.state_dict())
    if where is None:
        opt.step()
        assert checked == [(2, True)]
        monkeypatch.undo()  # the refusals were for opt: the twin steps unhindered
        ref.step()
        assert opt.skipped_steps == 0
        for p, q in zip(params, twins):
            assert torch.equal(bits(p), bits(q))
        return
    with pytest.warns(RuntimeWarning, match="non-finite") as caught:
        opt.step()
    assert checked == [(2, True)]
    name = "group0.param0" if where == 0 else "group1.param0"  # the unnamed parameters'
    assert any(name in str(w.message) for w in caught)
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, bits(p)) for a, p in zip(before[0], params))
    after = opt.state_dict()
    for index, state in before[1]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(bits(tensor), bits(after["state"][index][key])), (index, key)


def test_raise_on_a_planned_step_writes_nothing_and_the_next_step_is_planned(
        monkeypatch) -> None:
    """``nonfinite="raise"`` where every group has its plan ready: the one C call finds the
    inf (in the last tensor, read by the second thread) before any thread writes; the error
    names the parameter, nothing moved; the next, finite step is the one call's again and
    gives the general path's bits (the twin never plans)."""
    params, twins = _model("plus"), _model("plus")
    opt = collage.AdamW(params, lr=1e-2, strategy="plus", nonfinite="raise")
    ref = collage.AdamW(twins, lr=1e-2, strategy="plus", nonfinite="raise")
    plan_steps = _PlanSteps(monkeypatch)

    def step_both(step: int) -> None:
        for p, q, g in zip(params, twins, _grads(params, step)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        with monkeypatch.context() as plain:
            plain.setattr(NativePlan, "build", _NO_PLAN)
            ref.step()

    step_both(0)
    step_both(1)
    for p, g in zip(params, _grads(params, 2)):
        p.grad = g
    params[2].grad.view(-1)[-1] = float("inf")
    before = [bits(p) for p in params], copy.deepcopy(opt.state_dict())
    with pytest.raises(FloatingPointError, match="group0.param2"):
        opt.step()
    assert all(torch.equal(a, bits(p)) for a, p in zip(before[0], params))
    after = opt.state_dict()
    for index, state in before[1]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(bits(tensor), bits(after["state"][index][key])), (index, key)
    step_both(3)
    assert plan_steps.count == 2  # steps 1 and 3 (step 0 made the plan)
    _assert_same(params, opt, twins, ref)


@pytest.mark.parametrize("bad", [None, 0, 2])
def test_one_call_steps_groups_of_other_strategies_and_gradient_dtypes(bad, monkeypatch):
    """The one C call of planned groups reads each group's strategy, coefficients and
    gradient width from its own row: group 0 ``plus`` (bf16 weights and gradients), group 1
    ``fp32`` (float32 weights and gradients, checked 4 bytes at a time, the tensor cut
    between two threads) give the general path's bits; an inf in either group's last
    gradient element (``bad``: its tensor) skips the step with nothing written."""
    def run(plans: bool):
        params = _model("plus")[:2] + _model("fp32")[2:]
        opt = collage.AdamW([{"params": params[:2]},
                             {"params": params[2:], "strategy": "fp32", "weight_decay": 0.1}],
                            lr=1e-2, strategy="plus")
        with monkeypatch.context() as scope:
            scope.setattr(NativePlan, "build", _BUILD if plans else _NO_PLAN)
            plan_steps = _PlanSteps(scope)
            for step in range(4):
                for p, g in zip(params, _grads(params, step)):
                    p.grad = g
                if step == 2 and bad is not None:
                    params[bad].grad.view(-1)[-1] = float("inf")
                    before = [bits(p) for p in params], copy.deepcopy(opt.state_dict())
                    with pytest.warns(RuntimeWarning, match="non-finite"):
                        opt.step()
                    assert all(torch.equal(a, bits(p)) for a, p in zip(before[0], params))
                    after = opt.state_dict()["state"]
                    for index, state in before[1]["state"].items():
                        for key, tensor in state.items():
                            assert torch.equal(bits(tensor), bits(after[index][key]))
                    continue
                opt.step()
        return params, opt, plan_steps.count

    params, opt, count = run(True)
    twin_params, twin_opt, twin_count = run(False)
    assert twin_count == 0 and count == 2 * (3 if bad is None else 2)
    _assert_same(params, opt, twin_params, twin_opt)
