"""``step_in_backward=True`` (optim/backward.py, docs/memory.md).

* bit for bit the weights and states of ``step()`` after backward, for every rule and
  strategy on the reference, per-tensor, foreach and native paths (and the Triton kernels
  through the interpreter), with ``p.grad`` freed in backward and ``last_paths`` kept;
* the measured metrics, a scheduler's learning rates, ``state_dict`` and deepcopy;
* what it cannot do, refused with errors naming the fix: ``clip_grad_norm_``, GradScaler,
  ``capturable``, DDP over several ranks, FSDP2 (a real one-rank gloo process group);
* the non-finite policy, per parameter.

The reference is always the same optimizer class stepping after backward (``step()``):
nothing here computes an expected value with the code under test's in-backward path.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import collage
from collage.optim import backward as backward_module
from collage.optim.strategies import get_strategy

from ._common import PATHS, RULE_CASES, assert_bitwise_equal, batch, make_mlp, snapshot, \
    weight_dtype

STEPS = 3


def _cases():
    """(rule, strategy, path): every rule x strategy on the paths whose arithmetic is the
    same in both modes. ``fused`` runs the native C kernels (AdamW on CPU); for SGD and Lion
    it would compile with inductor (seconds per case) and is left to the AdamW cases."""
    for rule in RULE_CASES:
        for strategy in collage.STRATEGIES:
            allowed = get_strategy(strategy).rules
            if allowed is not None and rule.cls.__name__.lower() not in allowed:
                continue
            for path in PATHS:
                if path == "fused" and rule.name != "adamw":
                    continue
                yield pytest.param(rule, strategy, path, id=f"{rule}-{strategy}-{path}")


def _train(rule, strategy: str, path: str, in_backward: bool, *, steps: int = STEPS,
           **extra) -> tuple[dict, dict, list]:
    model = make_mlp(weight_dtype(strategy))
    opt = rule.make(model.named_parameters(), strategy, path, step_in_backward=in_backward,
                    **extra)
    grads_after_backward = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, weight_dtype(strategy))
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        grads_after_backward.append([p.grad is None for p in model.parameters()])
        opt.step()
    return snapshot(model, opt), opt.last_paths, grads_after_backward


@pytest.mark.parametrize(("rule", "strategy", "path"), list(_cases()))
def test_in_backward_equals_step_after_backward(rule, strategy, path):
    after, paths_after, grads_after = _train(rule, strategy, path, in_backward=False)
    during, paths_during, grads_during = _train(rule, strategy, path, in_backward=True)
    assert_bitwise_equal(during, after)
    assert paths_during == paths_after
    assert all(all(freed) for freed in grads_during)  # every gradient freed in backward
    assert not any(any(freed) for freed in grads_after)  # (the control kept them)


@pytest.mark.triton
def test_in_backward_triton_interpreted(triton_interpreter):
    """The Triton kernels (interpreted on CPU) step each parameter in backward as they
    step the whole group after it."""
    pytest.importorskip("triton")
    rule = RULE_CASES[0]
    runs = []
    for in_backward in (False, True):
        model = make_mlp()
        opt = rule.cls(model.parameters(), strategy="plus", fused="triton",
                       step_in_backward=in_backward, **rule.kwargs)
        for step in range(2):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
        runs.append((snapshot(model, opt), opt.last_paths))
    assert runs[0][1] == runs[1][1] == {0: "triton"}
    assert_bitwise_equal(runs[1][0], runs[0][0])


def test_measured_metrics_match():
    """track_updates: the per-parameter sums of the hooks add up to step()'s. The sums are
    float64 sums of the same float64 terms in another order (hooks run in backward order):
    a relative 1e-12 covers the reordering (a few ulps of float64), not a real change."""
    rule = RULE_CASES[0]
    stats = []
    for in_backward in (False, True):
        model = make_mlp()
        opt = rule.make(model.named_parameters(), "plus", "foreach",
                        step_in_backward=in_backward, track_updates=True)
        for step in range(2):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
        stats.append(opt.update_stats)
    assert stats[0].keys() == stats[1].keys() and stats[0]["edq"] > 0
    for key, value in stats[0].items():
        assert stats[1][key] == pytest.approx(value, rel=1e-12, abs=0), key


def test_scheduler_learning_rate_read_in_the_hooks():
    """A scheduler steps after step(), as torch wants (no order warning); the next
    backward's hooks read the new learning rate: same bits as stepping after backward."""
    rule = RULE_CASES[0]
    runs = []
    for in_backward in (False, True):
        model = make_mlp()
        opt = rule.make(model.parameters(), "plus", "foreach", step_in_backward=in_backward)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "scheduler.step() before
            for step in range(STEPS):       # optimizer.step()" warning included
                opt.zero_grad()
                x, y = batch(step)
                torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
                opt.step()
                sched.step()
        runs.append(snapshot(model, opt))
        assert opt.param_groups[0]["lr"] == rule.kwargs["lr"] * 0.5 ** STEPS
    assert_bitwise_equal(runs[1], runs[0])


def _loss(model, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def test_state_dict_and_deepcopy_continue_bitwise():
    """A state_dict saved after 2 steps and loaded into a new step-in-backward optimizer,
    and a deepcopy of model and optimizer, continue as the original does."""
    rule = RULE_CASES[0]
    model = make_mlp()
    opt = rule.make(model.parameters(), "plus", "foreach", step_in_backward=True)
    for step in range(2):
        _loss(model, step).backward()
        opt.step()
    twin_model, twin_opt = copy.deepcopy((model, opt))
    loaded_model = copy.deepcopy(model)
    loaded_opt = rule.make(loaded_model.parameters(), "plus", "foreach",
                           step_in_backward=True)
    loaded_opt.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (twin_model, twin_opt), (loaded_model, loaded_opt)):
        _loss(m, 2).backward()
        assert all(p.grad is None for p in m.parameters())  # stepped in backward
        o.step()
    assert_bitwise_equal(snapshot(twin_model, twin_opt), snapshot(model, opt))
    assert_bitwise_equal(snapshot(loaded_model, loaded_opt), snapshot(model, opt))


def test_grad_set_by_hand_is_stepped_by_step():
    """A gradient that did not come from backward (no hook ran) is stepped by step()."""
    rule = RULE_CASES[0]
    runs = []
    for in_backward in (False, True):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 9).to(torch.bfloat16))
        opt = rule.make([p], "plus", "foreach", step_in_backward=in_backward)
        p.grad = torch.linspace(0.5, -0.25, 9).to(torch.bfloat16)
        opt.step()
        # consumed under the step in backward, as a hook consumes its gradient; kept
        # without it, as torch.optim keeps it
        assert (p.grad is None) == in_backward
        runs.append({"p": p.detach().clone()})
    assert not torch.equal(runs[0]["p"], torch.linspace(-1, 1, 9).to(torch.bfloat16))
    assert_bitwise_equal(runs[1], runs[0])


# ----------------------------------------------------------------------------- non-finite

def _two_params(nonfinite: str, in_backward: bool = True):
    a = torch.nn.Parameter(torch.linspace(-1, 1, 5).to(torch.bfloat16))
    b = torch.nn.Parameter(torch.linspace(2, 3, 5).to(torch.bfloat16))
    opt = collage.AdamW([("a", a), ("b", b)], lr=1e-2, step_in_backward=in_backward,
                        nonfinite=nonfinite, foreach=True)
    return a, b, opt


def _backward_inf_in_b(a, b) -> None:
    scale = torch.tensor([1.0, float("inf"), 1.0, 1.0, 1.0], dtype=torch.bfloat16)
    ((a * 0.5).sum() + (b * scale).sum()).float().backward()


def test_nonfinite_skip_is_per_parameter():
    """nonfinite='skip': the parameter with an inf gradient and its state are unchanged;
    the other is stepped as step() steps it alone; step() counts one skipped step and
    names the parameter."""
    a, b, opt = _two_params("skip")
    b_before = b.detach().clone()
    _backward_inf_in_b(a, b)
    with pytest.warns(RuntimeWarning, match="'b'"):
        opt.step()
    assert opt.skipped_steps == 1
    assert torch.equal(b.detach(), b_before) and not opt.state[b]
    # the control: a alone, stepped after backward on the same gradient
    a_ref = torch.nn.Parameter(torch.linspace(-1, 1, 5).to(torch.bfloat16))
    ref = collage.AdamW([a_ref], lr=1e-2, foreach=True)
    (a_ref * 0.5).sum().float().backward()
    ref.step()
    assert_bitwise_equal({"a": a.detach()}, {"a": a_ref.detach()})


def test_nonfinite_raise_in_backward():
    a, b, opt = _two_params("raise")
    b_before = b.detach().clone()
    with pytest.raises(FloatingPointError, match="'b'.*step_in_backward=True"):
        _backward_inf_in_b(a, b)
    assert torch.equal(b.detach(), b_before)


def test_nonfinite_ignore_steps_everything():
    a, b, opt = _two_params("ignore")
    _backward_inf_in_b(a, b)
    opt.step()
    assert opt.skipped_steps == 0 and not torch.isfinite(b.detach()).all()


# ----------------------------------------------------------------------------- refusals

def test_clip_grad_norm_refused():
    a, b, opt = _two_params("skip")
    with pytest.raises(RuntimeError, match="step_in_backward=False"):
        opt.clip_grad_norm_(1.0)


def test_grad_scaler_refused():
    """GradScaler checks p.grad for inf after backward, when the hooks have already stepped
    on scaled gradients: refused at its first scaler.step, the error saying why."""
    model = make_mlp()
    opt = collage.AdamW(model.parameters(), step_in_backward=True, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(_loss(model, 0)).backward()
    with pytest.raises(RuntimeError, match="GradScaler cannot be used with step_in_backward"):
        scaler.step(opt)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"step_in_backward": "yes"}, TypeError, "step_in_backward must be True or False"),
    ({"step_in_backward": True, "grad_accumulation": "pair"}, ValueError,
     "grad_accumulation='pair' needs step_in_backward=False"),
    ({"step_in_backward": True, "capturable": True, "nonfinite": "ignore"}, ValueError,
     "use step_in_backward=False"),
])
def test_bad_keywords(kwargs, error, match):
    with pytest.raises(error, match=match):
        collage.AdamW(make_mlp().parameters(), **kwargs)


def test_ddp_over_several_ranks_refused(monkeypatch):
    """Under DDP the hook fires on the local gradient before the all-reduce: with a process
    group of several ranks, refused at construction (and in the hook, for a group made
    after the optimizer)."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(NotImplementedError, match="DDP.*2 ranks.*reduced"):
        collage.AdamW(make_mlp().parameters(), step_in_backward=True)


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist = torch.distributed
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_gloo")
def test_fsdp2_refused():
    """A real FSDP2 model (one gloo rank): its parameters are DTensors whose gradients FSDP2
    assigns after backward, which no hook sees: refused at construction."""
    model = make_mlp(torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(NotImplementedError, match="FSDP2"):
        collage.AdamW(model.parameters(), strategy="fp32", step_in_backward=True)


@pytest.mark.usefixtures("one_rank_gloo")
def test_ddp_refused_at_step():
    """A real DDP model (one gloo rank): DDP writes the all-reduced gradient into p.grad at
    the end of backward, after the hook stepped and freed it (the hook saw the local one).
    step() refuses, naming the parameter and DDP, instead of stepping a second time."""
    model = make_mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = collage.AdamW(model.named_parameters(), foreach=True, step_in_backward=True)
    x, y = batch(0)
    torch.nn.functional.mse_loss(ddp(x).float(), y.float()).backward()
    with pytest.raises(RuntimeError, match="'fc.*DDP"):
        opt.step()


@pytest.mark.usefixtures("one_rank_gloo")
def test_pair_under_one_rank_ddp_steps_the_gradient_ddp_wrote():
    """grad_accumulation="pair" keeps the sum's high half in p.grad: DDP's all-reduced
    gradient, written there at the end of backward, replaces it, and the user's (DDP's)
    value wins: the step is a plain optimizer's on the same p.grad, bit for bit."""
    stepped = []
    for kwargs in ({"grad_accumulation": "pair"}, {}):
        model = make_mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = collage.AdamW(model.named_parameters(), foreach=True, **kwargs)
        x, y = batch(0)
        torch.nn.functional.mse_loss(ddp(x).float(), y.float()).backward()
        opt.step()
        stepped.append(snapshot(model, opt))
    assert_bitwise_equal(*stepped)


# ------------------------------------------------------------------------------ buckets

def _many_layers(n: int = 24) -> torch.nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        layers = [torch.nn.Linear(16, 16) for _ in range(n)]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def _steps_counted(monkeypatch, in_backward: bool, **limits) -> tuple[dict, list[int]]:
    """Three training steps of a 48-parameter model on the native path; the kernel calls
    (``dispatch.run``) of each backward, counted"""
    for name, value in limits.items():
        monkeypatch.setattr(backward_module, name, value)
    calls = []
    real_run = backward_module.dispatch.run
    monkeypatch.setattr(backward_module.dispatch, "run",
                        lambda ready: calls.append(1) or real_run(ready))
    model = _many_layers()
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="plus",
                        step_in_backward=in_backward)
    per_backward = []
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        before = len(calls)
        model(x.to(torch.bfloat16)).float().square().mean().backward()
        per_backward.append(len(calls) - before)
        assert all(p.grad is None for p in model.parameters()) == in_backward
        opt.step()
        opt.zero_grad()
    return snapshot(model, opt), per_backward


def test_in_backward_steps_buckets_not_parameters(monkeypatch):
    """The hooks hand their parameters to a bucket, stepped by one call per group at
    1/BUCKETS of the elements and at the end of backward: 48 parameters in 16 + 1 calls at
    most (not 48), bit for bit step()'s result; one bucket (BUCKETS = 1) steps a
    backward in one call, a bucket of one element per parameter in 48, with the same bits."""
    after, _ = _steps_counted(monkeypatch, in_backward=False)
    during, calls = _steps_counted(monkeypatch, in_backward=True)
    assert_bitwise_equal(during, after)
    assert all(1 < count <= 17 for count in calls), calls
    whole, calls = _steps_counted(monkeypatch, in_backward=True, BUCKETS=1)
    assert_bitwise_equal(whole, after)
    assert calls == [1, 1, 1]
    single, calls = _steps_counted(monkeypatch, in_backward=True, BUCKET_MAX_ELEMENTS=1)
    assert_bitwise_equal(single, after)
    assert calls == [48, 48, 48]


def test_in_backward_bucket_frees_its_gradients_before_backward_ends(monkeypatch):
    """A stepped bucket's gradients are freed at once: with a bucket per parameter, when the
    first layer's hook runs (the last of the backward), the later layers' gradients are
    gone (their memory is what the step in backward saves)."""
    model = _many_layers(4)
    opt = collage.AdamW(model.parameters(), lr=1e-2, strategy="plus", step_in_backward=True)
    seen = []
    first = model[0].weight
    first.register_post_accumulate_grad_hook(
        lambda p: seen.append([q.grad is None for q in model[2:].parameters()]))
    monkeypatch.setattr(backward_module, "BUCKET_MAX_ELEMENTS", 1)
    model(torch.ones(2, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert seen == [[True] * 4]
