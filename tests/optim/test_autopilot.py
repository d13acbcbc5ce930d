"""The precision autopilot (``strategy="auto"``, issue #43, ``docs/autopilot.md``).

Exact expectations from the arithmetic:

* a tensor of ones whose every update is at most ``1e-4`` in magnitude: the bf16 spacing
  below 1.0 is ``2**-8`` and above it ``2**-7``, so ``RN(1 + u) == 1`` for ``|u| < 2**-9``
  (0.00195): every intended update is lost (lost fraction exactly 1.0), so the tensor is
  promoted at the first measured step; at ``light`` (a pair keeping ~16 bits: updates
  down to about ``2**-17`` of the weight land) it loses none and stays;
* a tensor of weights in ``[1e-3, 2e-3)`` under updates of about ``1e-4`` (AdamW's first
  steps on a constant gradient: ``lr`` times a ratio within bf16's rounding of 1; SGD
  ``lr * g`` with ``g`` in ``[0.5, 1)``; Lion exactly ``lr``), staying below ``2**-8``:
  its bf16 spacing is at most ``2**-16`` (half: 7.6e-6), far below every update: none is
  lost (lost fraction exactly 0.0), never promoted.
"""

from __future__ import annotations

import copy

import pytest
import torch

import collage
from collage.metrics import JSONLinesWriter
from collage.optim.autopilot import AUTO, Autopilot, Decision, strategy_bytes
from collage.optim.rules import ADAMW, LION, SGD
from collage.optim.strategies import NAMES, get_strategy

from ._common import assert_bitwise_equal, roundtrip

BF16 = torch.bfloat16
N = 300  # a native block and a tail

#: the rules with hyperparameters whose every update is at most 1e-4 (module docstring)
RULES = {
    "adamw": (collage.AdamW, {"lr": 1e-4, "betas": (0.9, 0.999), "weight_decay": 0.0}),
    "sgd": (collage.SGD, {"lr": 1e-4, "momentum": 0.0}),
    "lion": (collage.Lion, {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}),
}
#: the paths, by their flags (``fused=True``: the native kernels for AdamW, compiled for
#: SGD and Lion, which the native kernels do not cover)
PATHS = {
    "default": {},
    "foreach": {"foreach": True},
    "per_tensor": {"foreach": False},
    "reference": {"reference": True},
    "fused": {"fused": True},
}
EXPECTED_PATH = {"default": {"adamw": "native", "sgd": "foreach", "lion": "foreach"},
                 "fused": {"adamw": "native", "sgd": "compiled", "lion": "compiled"}}


def _params():
    g = torch.Generator().manual_seed(3)
    ones = torch.nn.Parameter(torch.ones(N, dtype=BF16))
    small = torch.nn.Parameter((1e-3 + 1e-3 * torch.rand(N, generator=g)).to(BF16))
    grad = (0.5 + 0.5 * torch.rand(N, generator=g)).to(BF16)  # constant, in [0.5, 1)
    return ones, small, grad


def _make(rule: str, path: str, params, **extra):
    cls, kwargs = RULES[rule]
    return cls(params, **kwargs, **PATHS[path], **extra)


def _run(opt, params, grad, steps: int, start: int = 0) -> None:
    for _ in range(start, steps):
        for p in params:
            p.grad = grad.clone()
        opt.step()


def _snapshot(opt, named) -> dict:
    out = {f"param/{n}": p.detach().clone() for n, p in named}
    for n, p in named:
        out.update({f"state/{n}/{k}": v.clone() for k, v in opt.state[p].items()})
    return out


def _slow_path(rule: str, path: str) -> bool:
    return path == "fused" and rule != "adamw"  # inductor compiles: seconds per kernel


CASES = [pytest.param(rule, path, marks=[pytest.mark.slow] if _slow_path(rule, path) else [])
         for rule in RULES for path in PATHS]


@pytest.mark.parametrize(("rule", "path"), CASES)
def test_a_lost_tensor_is_promoted_at_once_and_a_landing_one_never(rule, path):
    ones, small, grad = _params()
    opt = _make(rule, path, [("ones", ones), ("small", small)], strategy=AUTO,
                autopilot=Autopilot(every=1))
    assert opt.strategy_of(ones) == opt.strategy_of(small) == NAMES.bf16
    _run(opt, [ones, small], grad, 1)
    assert opt.update_stats["imprecision/ones"] == 1.0
    assert opt.update_stats["imprecision/small"] == 0.0
    assert opt.autopilot_decisions == [Decision(0, "ones", NAMES.bf16, NAMES.light, 1.0)]
    assert (opt.strategy_of(ones), opt.strategy_of(small)) == (NAMES.light, NAMES.bf16)
    assert torch.equal(ones.detach(), torch.ones(N, dtype=BF16))  # the promotion is exact
    assert torch.equal(opt.state[ones]["weight_lo"], torch.zeros(N, dtype=BF16))
    _run(opt, [ones, small], grad, 5, start=1)
    assert opt.update_stats["imprecision/ones"] == 0.0  # light lands them all
    assert opt.update_stats["imprecision/small"] == 0.0
    assert len(opt.autopilot_decisions) == 1
    assert (opt.strategy_of(ones), opt.strategy_of(small)) == (NAMES.light, NAMES.bf16)
    # (bf16 weights 1 - k u land in the pair: the represented value moved)
    assert float(ones.detach().double().add(opt.state[ones]["weight_lo"].double()).max()) < 1
    # (AdamW: (10 + 8) / 2, the gradient's 2 bytes included)
    assert opt.update_stats["auto/bytes_per_param"] == (
        strategy_bytes(get_strategy(NAMES.bf16), opt.rule)
        + strategy_bytes(get_strategy(NAMES.light), opt.rule)) / 2
    if path in EXPECTED_PATH:
        assert opt.last_paths[0] == EXPECTED_PATH[path][rule]


@pytest.mark.parametrize(("rule", "path"), CASES)
def test_each_rung_steps_as_its_strategy_bit_for_bit(rule, path):
    """An auto group is bit for bit two groups of fixed strategies, the promoted tensor's
    converted by setting its group's strategy (``convert.py``) after the same step."""
    ones, small, grad = _params()
    auto = _make(rule, path, [("ones", ones), ("small", small)], strategy=AUTO,
                 autopilot=Autopilot(every=1))
    _run(auto, [ones, small], grad, 6)

    ones2, small2, _ = _params()
    fixed = _make(rule, path, [
        {"params": [ones2], "param_names": ["ones"], "strategy": NAMES.bf16},
        {"params": [small2], "param_names": ["small"], "strategy": NAMES.bf16}])
    _run(fixed, [ones2, small2], grad, 1)
    fixed.param_groups[0]["strategy"] = NAMES.light
    _run(fixed, [ones2, small2], grad, 6, start=1)
    assert_bitwise_equal(_snapshot(auto, [("ones", ones), ("small", small)]),
                         _snapshot(fixed, [("ones", ones2), ("small", small2)]))


def _model(seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                    torch.nn.Linear(32, 4))
    with torch.no_grad():
        model[1].weight.fill_(1.0)  # norm gains at 1.0: bf16 loses their small updates
    return model.to(BF16)


def _train(model, opt, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=g).to(BF16), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()


def _auto_adamw(model, **extra):
    return collage.AdamW(model.named_parameters(), lr=3e-4, weight_decay=0.1,
                         strategy=AUTO, autopilot=Autopilot(every=3, threshold=0.3), **extra)


def _model_snapshot(model, opt) -> dict:
    return _snapshot(opt, list(model.named_parameters()))


@pytest.mark.parametrize("path", ["default", "foreach", "reference"])
def test_resume_from_a_state_dict_continues_bit_for_bit(path):
    straight = _model()
    straight_opt = _auto_adamw(straight, **PATHS[path])
    _train(straight, straight_opt, range(20))
    assert straight_opt.autopilot_decisions  # something was promoted on the way

    first = _model()
    first_opt = _auto_adamw(first, **PATHS[path])
    _train(first, first_opt, range(10))
    saved = roundtrip({"model": first.state_dict(), "opt": first_opt.state_dict()})
    rungs = {name: first_opt.strategy_of(p) for name, p in first.named_parameters()}
    assert len(set(rungs.values())) > 1  # a mix of rungs is saved

    resumed = _model(seed=1)  # other weights: the load must set them all
    resumed_opt = _auto_adamw(resumed, **PATHS[path])
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    assert {n: resumed_opt.strategy_of(p) for n, p in resumed.named_parameters()} == rungs
    assert resumed_opt.autopilot_decisions == first_opt.autopilot_decisions  # the log too
    _train(resumed, resumed_opt, range(10, 20))
    assert_bitwise_equal(_model_snapshot(straight, straight_opt),
                         _model_snapshot(resumed, resumed_opt))
    assert resumed_opt.autopilot_decisions == straight_opt.autopilot_decisions
    assert {n: straight_opt.strategy_of(p) for n, p in straight.named_parameters()} == {
        n: resumed_opt.strategy_of(p) for n, p in resumed.named_parameters()}


@pytest.mark.skipif(not torch.distributed.is_available(),
                    reason="this torch build has no torch.distributed")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_distributed_checkpoint_resumes_bit_for_bit_through_adopt_rungs(tmp_path):
    """torch.distributed.checkpoint (one process, no process group) loads only the keys of
    the template a fresh optimizer makes, where every tensor is at the first rung: a
    promoted tensor's low parts were silently left behind (every tensor back at bf16).
    Its saved state now names its rung: a load with the fresh template is refused,
    naming the parameter, the rung and the fix; adopt_rungs, then a new template, resumes
    bit for bit."""
    import torch.distributed.checkpoint as dcp  # (here: the skip above guards the import)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    straight = _model()
    straight_opt = _auto_adamw(straight)
    _train(straight, straight_opt, range(20))
    first = _model()
    first_opt = _auto_adamw(first)
    _train(first, first_opt, range(10))
    rungs = {name: first_opt.strategy_of(p) for name, p in first.named_parameters()}
    assert set(rungs.values()) > {NAMES.bf16}  # promoted tensors are saved
    model_sd, optim_sd = get_state_dict(first, first_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))

    def template(model, opt) -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    naive = _model(seed=1)
    naive_opt = _auto_adamw(naive)
    state = template(naive, naive_opt)
    dcp.load(state, checkpoint_id=str(tmp_path))
    with pytest.raises(ValueError, match=r"was at the autopilot's rung '(light|plus)'.*"
                                         r"adopt_rungs"):
        set_state_dict(naive, naive_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    resumed = _model(seed=1)
    resumed_opt = _auto_adamw(resumed)
    state = template(resumed, resumed_opt)
    dcp.load(state, checkpoint_id=str(tmp_path))
    assert resumed_opt.adopt_rungs(state["optim"]) == sum(
        rung != NAMES.bf16 for rung in rungs.values())
    state = template(resumed, resumed_opt)  # now with every rung's components
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    assert {n: resumed_opt.strategy_of(p) for n, p in resumed.named_parameters()} == rungs
    _train(resumed, resumed_opt, range(10, 20))
    assert_bitwise_equal(_model_snapshot(straight, straight_opt),
                         _model_snapshot(resumed, resumed_opt))


def test_copies_keep_each_tensors_strategy():
    model = _model()
    opt = _auto_adamw(model)
    _train(model, opt, range(4))
    promoted = {n for n, p in model.named_parameters() if opt.strategy_of(p) != NAMES.bf16}
    assert promoted  # the norm gain at least
    clone = copy.deepcopy({"model": model, "opt": opt})
    named = dict(clone["model"].named_parameters())
    assert {n for n, p in named.items() if clone["opt"].strategy_of(p) != NAMES.bf16} == promoted
    _train(model, opt, range(4, 8))
    _train(clone["model"], clone["opt"], range(4, 8))
    assert_bitwise_equal(_model_snapshot(model, opt), _model_snapshot(clone["model"],
                                                                      clone["opt"]))


def test_consolidate_reads_each_tensor_at_its_rung():
    model = _model()
    opt = _auto_adamw(model)
    _train(model, opt, range(7))
    full = collage.consolidate(model, opt)
    for name, param in model.named_parameters():
        lo = opt.state[param].get("weight_lo")
        expected = param.double() + (0 if lo is None else lo.double())
        assert torch.equal(full[name], expected.float()), name


def test_a_state_of_no_rung_is_refused_naming_the_parameter():
    model = _model()
    opt = collage.AdamW(model.named_parameters(), strategy=NAMES.mixed)
    _train(model, opt, range(1))
    sd = opt.state_dict()
    sd["param_groups"] = [{**g, "strategy": AUTO} for g in sd["param_groups"]]
    auto = _auto_adamw(_model())
    with pytest.raises(ValueError, match=r"parameter '0.weight'.*no rung"):
        auto.load_state_dict(sd)
    assert not auto.state  # all or nothing


def test_leaving_and_entering_auto_converts_exactly():
    model = _model()
    opt = _auto_adamw(model)
    _train(model, opt, range(4))
    before = {n: collage.consolidate(model, opt)[n] for n, _ in model.named_parameters()}
    opt.param_groups[0]["strategy"] = NAMES.plus
    opt.zero_grad()
    opt.step()  # no gradients: converts, steps nothing
    after = collage.consolidate(model, opt)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert all(opt.strategy_of(p) == NAMES.plus for p in model.parameters())
    opt.param_groups[0]["strategy"] = AUTO  # from a rung of the ladder: kept there
    opt.step()
    assert all(opt.strategy_of(p) == NAMES.plus for p in model.parameters())
    opt.param_groups[0]["strategy"] = NAMES.mixed
    opt.step()
    opt.param_groups[0]["strategy"] = AUTO
    with pytest.raises(ValueError, match="cannot move from strategy 'mixed' to 'auto'"):
        opt.step()


def test_decisions_go_to_the_sinks(tmp_path):
    ones, small, grad = _params()
    path = tmp_path / "decisions.jsonl"
    with JSONLinesWriter(path) as sink:
        opt = collage.AdamW([("ones", ones), ("small", small)], lr=1e-4, weight_decay=0.0,
                            strategy=AUTO, autopilot=Autopilot(every=2, sinks=(sink,)))
        _run(opt, [ones, small], grad, 3)
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # steps 0 and 2
    assert '"step": 0' in lines[0] and '"auto/lost/ones": 1.0' in lines[0]
    assert '"auto/bytes_per_param": 9.0' in lines[1] and '"auto/promoted": 0.0' in lines[1]


def test_default_ladders_follow_the_rule():
    assert Autopilot().rungs_for(ADAMW) == tuple(
        get_strategy(n) for n in (NAMES.bf16, NAMES.light, NAMES.plus))
    # SGD's momentum is no slow EMA: plus stores it as light does, so plus is left out
    assert [s.name for s in Autopilot().rungs_for(SGD)] == [NAMES.bf16, NAMES.light]
    assert [s.name for s in Autopilot().rungs_for(LION)] == [NAMES.bf16, NAMES.light,
                                                             NAMES.plus]
    assert [strategy_bytes(s, ADAMW) for s in Autopilot().rungs_for(ADAMW)] == [8, 10, 12]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ladder": ("bf16", "lighter")}, r"autopilot ladder rung 'lighter' is unknown"),
    ({"ladder": ("light", "bf16")}, r"not ordered by bytes: 'bf16' keeps 8 .* 'light' 10"),
    ({"ladder": ("bf16", "stochastic")}, r"not ordered by bytes"),
    ({"ladder": ("bf16", "auto")}, r"rung 'auto' is not a storage strategy"),
    ({"ladder": "bf16"}, r"must be a sequence"),
    ({"ladder": ()}, r"at least one strategy"),
    ({"ladder": ("bf16", "bf16")}, r"each once"),
    ({"threshold": 1.5}, r"threshold must be a fraction"),
    ({"every": 0}, r"every must be an int >= 1"),
])
def test_bad_policies_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        collage.AdamW(_model().parameters(), strategy=AUTO, autopilot=Autopilot(**kwargs))


def test_a_rung_the_rule_cannot_step_is_refused():
    with pytest.raises(ValueError, match=r"rung 'plus8' cannot step Lion.*leave it out"):
        collage.Lion(_model().parameters(), strategy=AUTO,
                     autopilot=Autopilot(ladder=(NAMES.light, NAMES.plus8)))
    with pytest.raises(ValueError, match=r"'plus' keeps 8 bytes .* 'light' 8"):
        collage.SGD(_model().parameters(), momentum=0.9, strategy=AUTO,
                    autopilot=Autopilot(ladder=(NAMES.light, NAMES.plus)))


def test_auto_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="cannot step in backward"):
        collage.AdamW(_model().parameters(), strategy=AUTO, step_in_backward=True)
    with pytest.raises(TypeError, match=r"strategy 'auto' \(at its rung 'bf16'\) needs "
                                        "bfloat16 or float16 weights"):
        collage.AdamW(_model().float().parameters(), strategy=AUTO)
    with pytest.raises(ValueError, match="'auto' cannot be capturable"):
        collage.AdamW(_model().parameters(), strategy=AUTO, capturable=True)
    with pytest.raises(TypeError, match="must be a collage.Autopilot"):
        collage.AdamW(_model().parameters(), strategy=AUTO, autopilot={"every": 5})


def test_two_parameters_of_one_name_are_refused_under_auto():
    """Two modules' named_parameters() in two groups both name a tensor 'weight': the
    autopilot, which decides each tensor by the lost updates measured under its name,
    would judge them together (a tensor losing every update beside one losing none: 0.5,
    neither promoted). Refused at construction, at add_param_group and when a group is
    made 'auto', naming the name and both groups; a fixed strategy takes them, as
    torch.optim does."""
    def two_heads():
        return torch.nn.Linear(4, 4, dtype=BF16), torch.nn.Linear(4, 4, dtype=BF16)
    a, b = two_heads()
    with pytest.raises(ValueError, match=r"two parameters are named 'weight' \(param "
                                         r"groups 0 and 1\).*f'head\.\{n\}'"):
        collage.AdamW([{"params": a.named_parameters()}, {"params": b.named_parameters()}],
                      strategy=AUTO)
    opt = collage.AdamW(a.named_parameters(), strategy=AUTO)
    with pytest.raises(ValueError, match="two parameters are named 'weight'"):
        opt.add_param_group({"params": b.named_parameters(), "strategy": NAMES.plus})
    assert len(opt.param_groups) == 1
    opt = collage.AdamW([{"params": a.named_parameters()}, {"params": b.named_parameters()}],
                        strategy=NAMES.bf16)
    opt.param_groups[1]["strategy"] = AUTO
    with pytest.raises(ValueError, match=r"two parameters are named '(weight|bias)'"):
        opt.step()
    # unique names: accepted
    collage.AdamW([{"params": [(f"a.{n}", p) for n, p in a.named_parameters()]},
                   {"params": [(f"b.{n}", p) for n, p in b.named_parameters()]}],
                  strategy=AUTO)


def test_a_param_group_of_auto_beside_fixed_ones():
    model = _model()
    opt = collage.AdamW([
        {"params": list(model[0].parameters()), "strategy": NAMES.plus},
        {"params": list(model[1].parameters()), "strategy": AUTO}],
        lr=3e-4, autopilot=Autopilot(every=1))
    _train(model, opt, range(3))
    assert opt.strategy_of(model[0].weight) == NAMES.plus
    assert opt.strategy_of(model[1].weight) == NAMES.light  # norm gain at 1.0
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.strategy_of(model[2].weight)


def test_pair_accumulation_under_auto_is_the_fixed_mix_bit_for_bit():
    """grad_accumulation="pair" (the float32 sums of two backward passes) feeds the rungs
    as it feeds fixed groups."""

    def run(make):
        model = _model()
        opt = make(model)
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                g = torch.Generator().manual_seed(10 * step + micro)
                x, y = torch.randn(4, 16, generator=g).to(BF16), torch.randn(4, 4, generator=g)
                torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            if step == 0 and opt.param_groups[0]["strategy"] != AUTO:
                opt.param_groups[1]["strategy"] = NAMES.light  # what auto promoted
        return model, opt

    auto_model, auto = run(lambda m: collage.AdamW(
        m.named_parameters(), lr=3e-4, strategy=AUTO, grad_accumulation="pair",
        autopilot=Autopilot(every=100)))
    promoted = {n for n, p in auto_model.named_parameters()
                if auto.strategy_of(p) == NAMES.light}
    assert "1.weight" in promoted  # the norm gain at 1.0, at step 0
    assert {d.step for d in auto.autopilot_decisions} == {0}
    fixed_model, fixed = run(lambda m: collage.AdamW(
        [{"params": [p for n, p in m.named_parameters() if n not in promoted],
          "param_names": [n for n, _ in m.named_parameters() if n not in promoted]},
         {"params": [p for n, p in m.named_parameters() if n in promoted],
          "param_names": [n for n, _ in m.named_parameters() if n in promoted]}],
        lr=3e-4, strategy=NAMES.bf16, grad_accumulation="pair"))
    assert_bitwise_equal(_model_snapshot(auto_model, auto), _model_snapshot(fixed_model, fixed))
