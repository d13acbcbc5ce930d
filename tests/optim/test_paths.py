"""The one dispatch (optim/dispatch.py): which path the flags select, and the paths that must
agree bit for bit.

* ``foreach=False`` runs the same float32 arithmetic as ``foreach=True``, tensor by tensor
  (torch.optim's meaning): every rule x strategy, measured or not, large tensors (stepped in
  ranges) and small ones (batched by ``foreach=True``), GradScaler and ``maximize``.
* stochastic rounding draws the same numbers on every path (``draws.py``): where every path
  computes the same float32 value to round, every path rounds it the same way.
"""

from __future__ import annotations

import pytest
import torch

import collage
from collage.optim import compiled, dispatch, eager
from collage.optim.group import GroupStep, Item
from collage.optim.rules import ADAMW
from collage.optim.strategies import get_strategy

from ._common import RULE_CASES, assert_bitwise_equal, weight_dtype

# small tensors (batched by foreach=True), one above SMALL_NUMEL, one above EAGER_CHUNK
SHAPES = ((33,), (7, 5), (1,), (0,), (eager.SMALL_NUMEL + 3,), (eager.EAGER_CHUNK + 129,))


def _cases():
    for rule in RULE_CASES:
        for strategy in collage.STRATEGIES:
            allowed = get_strategy(strategy).rules
            if allowed is None or rule.cls.__name__.lower() in allowed:
                yield rule, strategy


def _run(rule, strategy: str, foreach: bool, *, track: bool = False, scale=None,
         maximize: bool = False) -> tuple[dict, str]:
    g = torch.Generator().manual_seed(7)
    dtype = weight_dtype(strategy)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 3).to(dtype)) for s in SHAPES]
    opt = rule.cls(params, strategy=strategy, foreach=foreach, track_updates=track,
                   maximize=maximize, **rule.kwargs)
    for step in range(3):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 10.0 ** (step - 3)
            p.grad = (grad * (scale or 1.0)).to(dtype)
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
        opt.step()
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"s{i}/{k}": v.clone() for k, v in opt.state[p].items()})
    return out, opt.last_paths[0], opt.update_stats


@pytest.mark.parametrize(("rule", "strategy"), list(_cases()), ids=str)
def test_per_tensor_equals_foreach(rule, strategy):
    a, path_a, _ = _run(rule, strategy, foreach=False)
    b, path_b, _ = _run(rule, strategy, foreach=True)
    assert (path_a, path_b) == ("per_tensor", "foreach")
    assert_bitwise_equal(a, b)


@pytest.mark.parametrize("strategy", ["plus", "stochastic", "plus8"])
def test_per_tensor_equals_foreach_measured_scaled_maximized(strategy):
    rule = RULE_CASES[0]
    a, _, stats_a = _run(rule, strategy, foreach=False, track=True, scale=1024.0,
                         maximize=True)
    b, _, stats_b = _run(rule, strategy, foreach=True, track=True, scale=1024.0,
                         maximize=True)
    assert_bitwise_equal(a, b)
    assert stats_a == stats_b and stats_a["edq"] > 0


def _stochastic_sgd(flags: dict) -> torch.Tensor:
    """SGD with lr = 1 on bf16 weights near 1 and gradients near 2**-12: ``w - g`` is exact
    in float32 on every path (bf16 operands within 2**16 of each other) and rarely a bf16
    value, so the result depends on the draws alone."""
    g = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter((1 + torch.rand(3000, generator=g)).to(torch.bfloat16))
    opt = collage.SGD([w], lr=1.0, strategy="stochastic", seed=123, **flags)
    for _ in range(3):
        w.grad = (torch.randn(3000, generator=g) * 2.0**-12).to(torch.bfloat16)
        opt.step()
    return w.detach().clone()


def test_every_path_draws_the_same_numbers():
    flags = {"per_tensor": {"foreach": False}, "foreach": {"foreach": True},
             "reference": {"reference": True}}
    if compiled.available():
        flags["compiled"] = {"fused": True}
    results = {name: _stochastic_sgd(f) for name, f in flags.items()}
    base = results.pop("per_tensor")
    assert torch.equal(base, _stochastic_sgd({"foreach": False}))  # deterministic
    for name, weights in results.items():
        assert torch.equal(base.view(torch.int16), weights.view(torch.int16)), name


def test_a_new_seed_draws_other_numbers():
    g = torch.Generator().manual_seed(5)
    w0 = (1 + torch.rand(3000, generator=g)).to(torch.bfloat16)
    grad = (torch.randn(3000, generator=g) * 2.0**-12).to(torch.bfloat16)
    results = []
    for seed in (1, 2):
        w = torch.nn.Parameter(w0.clone())
        opt = collage.SGD([w], lr=1.0, strategy="stochastic", seed=seed, foreach=True)
        w.grad = grad.clone()
        opt.step()
        results.append(w.detach())
    assert not torch.equal(results[0], results[1])


def _group(**flags) -> GroupStep:
    p = torch.zeros(4, dtype=torch.bfloat16)
    return GroupStep(ADAMW, get_strategy("plus"), {}, [Item("p", p, p, {}, 0)], **flags)


@pytest.mark.parametrize(("flags", "cpu", "cuda"), [
    ({"reference": True}, "reference", "reference"),
    ({"foreach": False}, "per_tensor", "per_tensor"),
    ({"foreach": True}, "foreach", "foreach"),
    ({"fused": False}, "foreach", "foreach"),
    ({"foreach": False, "fused": True}, "native", "compiled"),
    ({"fused": True}, "native", "compiled"),
    ({}, "native", "compiled"),
])
def test_the_flags_select_a_path(flags, cpu, cuda, monkeypatch):
    monkeypatch.setattr(dispatch.native, "covers", lambda *args: True)
    monkeypatch.setattr(compiled, "available", lambda: True)
    monkeypatch.setattr(dispatch.triton_path, "unavailable", lambda *args: "no Triton")
    assert dispatch.choose(_group(**flags), torch.device("cpu")) == cpu
    monkeypatch.setattr(dispatch.native, "covers", lambda *args: False)
    assert dispatch.choose(_group(**flags), torch.device("cuda")) == cuda


@pytest.mark.parametrize(("flags", "cpu", "cuda"), [
    ({"fused": "triton"}, "triton", "triton"),
    ({"fused": True}, "native", "triton"),
    ({}, "native", "triton"),
    ({"fused": False}, "foreach", "foreach"),
    ({"foreach": True}, "foreach", "foreach"),
])
def test_the_triton_kernels_where_they_run(flags, cpu, cuda, monkeypatch):
    """``fused="triton"`` anywhere they run (CPU: the interpreter); on CUDA also
    ``fused=True`` and the default."""
    monkeypatch.setattr(dispatch.native, "covers", lambda *args: True)
    monkeypatch.setattr(dispatch.triton_path, "unavailable", lambda *args: None)
    assert dispatch.choose(_group(**flags), torch.device("cpu")) == cpu
    assert dispatch.choose(_group(**flags), torch.device("cuda")) == cuda


def test_fused_triton_where_it_cannot_run_warns_once_and_runs_fused(monkeypatch):
    monkeypatch.setattr(dispatch.native, "covers", lambda *args: False)
    monkeypatch.setattr(compiled, "available", lambda: True)
    monkeypatch.setattr(dispatch.triton_path, "unavailable", lambda *args: "no Triton here")
    warnings = []
    group = _group(fused="triton")
    group.warn = warnings.append
    assert dispatch.choose(group, torch.device("cuda")) == "compiled"
    assert len(warnings) == 1 and "no Triton here" in warnings[0]


def test_capturable_runs_the_triton_kernels_or_says_why_not(monkeypatch):
    group = _group()
    group.hyper = {"capturable": True}
    monkeypatch.setattr(dispatch.triton_path, "unavailable", lambda *args: None)
    assert dispatch.choose(group, torch.device("cuda")) == "triton"
    monkeypatch.setattr(dispatch.triton_path, "unavailable", lambda *args: "no Triton here")
    with pytest.raises(RuntimeError, match="capturable=True.*no Triton here"):
        dispatch.choose(group, torch.device("cuda"))


def test_fused_without_a_compiler_warns_once_and_runs_foreach(monkeypatch):
    monkeypatch.setattr(dispatch.native, "covers", lambda *args: False)
    monkeypatch.setattr(compiled, "available", lambda: False)
    warnings = []
    group = _group(fused=True)
    group.warn = warnings.append
    assert dispatch.choose(group, torch.device("cpu")) == "foreach"
    assert warnings and "compiler" in warnings[0]
    group = _group()  # the default never warns: nothing was asked for
    group.warn = warnings.append
    assert dispatch.choose(group, torch.device("cpu")) == "foreach" and len(warnings) == 1
