"""The compiled path's (inductor) kernels: no recompilation when a scheduler changes a
coefficient, the group kernel equals the per-parameter kernel bit for bit, and its
in-kernel stochastic rounding is exact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import collage
from collage.optim import compiled, draws, eager, get_strategy, kernels
from collage.optim.rounding import _stochastic_round_bf16, stochastic_round
from collage.optim.rules import ADAMW

# the inductor kernels (on CPU, AdamW groups would otherwise run the native C kernels,
# tested in tests/optim/test_native.py)
pytestmark = [pytest.mark.skipif(not compiled.available(),
                                 reason="no C++ compiler for inductor"),
              pytest.mark.usefixtures("inductor_only")]

# one tensor above eager.SMALL_NUMEL (its own kernel call), several below (one bucket)
SHAPES = [(160, 128), (64,), (3, 5), (1000,), (1,)]


def _params(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(step, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def test_shapes_exercise_both_call_kinds():
    sizes = [torch.Size(s).numel() for s in SHAPES]
    assert any(n >= eager.SMALL_NUMEL for n in sizes)
    assert sum(n < eager.SMALL_NUMEL for n in sizes) >= 2


def _one_cycle(rule: str) -> tuple[torch.optim.Optimizer, int, int]:
    """Steps under OneCycleLR, which cycles the learning rate and the momentum (SGD's
    momentum, Adam's and Lion's beta1; cycle_momentum=True is its default): returns the
    optimizer and dynamo's graph count after the first two steps and at the end, the later
    steps run with error_on_recompile."""
    make = {"sgd": lambda p: collage.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2,
                                         strategy="light", fused=True),
            "adamw": lambda p: collage.AdamW(p, lr=1e-3, strategy="light", fused=True),
            "lion": lambda p: collage.Lion(p, lr=1e-4, weight_decay=0.1, strategy="light",
                                           fused=True)}[rule]
    params = _params()
    opt = make(params)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=20)

    def step(index):
        for p, g in zip(params, _grads(index)):
            p.grad = g
        opt.step()
        schedule.step()

    step(0)
    step(1)  # SGD: the first step's buffer copy, then the later steps' formula
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for index in range(2, 10):
            step(index)
    return opt, graphs, counters["stats"]["unique_graphs"]


def test_one_cycle_schedule_never_recompiles_sgd():
    """Every coefficient a scheduler changes (the learning rate, SGD's momentum, beta1,
    weight decay) enters the compiled kernels as data: under OneCycleLR nothing recompiles
    (issue #25: SGD's momentum was static, and recompiled at every step)."""
    opt, before, after = _one_cycle("sgd")
    assert opt.last_paths == {0: "compiled"} and before == after


_COLD_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import torch
from collage.optim import native
from optim import test_compiled
native.covers = lambda *args, **kwargs: False  # AdamW on CPU: the compiled kernels too
for rule in ("sgd", "adamw", "lion"):
    opt, before, after = test_compiled._one_cycle(rule)
    assert opt.last_paths == {{0: "compiled"}} and before == after, (rule, before, after)
print("ok")
"""


@pytest.mark.slow
def test_one_cycle_schedule_never_recompiles_with_a_cold_cache(tmp_path):
    """The same for SGD, AdamW and Lion in a fresh process with an empty inductor cache,
    where a recompilation would also cost a C++ compilation."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    code = _COLD_CHILD.format(tests=os.path.dirname(os.path.dirname(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_learning_rate_schedule_never_recompiles():
    params = _params()
    opt = collage.AdamW(params, lr=1e-3, strategy="plus", fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()  # compiles (once per kernel variant)
    schedule.step()
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    frames = counters["stats"]["calls_captured"]
    lrs = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, 6):
            for p, g in zip(params, _grads(step)):
                p.grad = g
            opt.param_groups[0]["weight_decay"] = 0.01 * step  # also new data, not code
            opt.step()
            schedule.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert len(set(lrs)) == len(lrs)  # the learning rate really changed every step
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["stats"]["calls_captured"] == frames


@pytest.mark.parametrize("strategy", ["plus", "stochastic"])
def test_group_path_equals_per_parameter_kernel(strategy):
    """The group path (bf16 gradients converted in the kernel, small tensors concatenated,
    uniforms hashed in the kernel) equals the per-parameter compiled kernel fed float32
    gradients and the same uniforms drawn eagerly, bit for bit, over several steps."""
    st = get_strategy(strategy)
    params = _params()
    opt = collage.AdamW(params, lr=1e-2, weight_decay=0.1, strategy=strategy, fused=True)
    shadow = [p.detach().clone() for p in params]
    shadow_state = [{} for _ in params]
    for p, s in zip(shadow, shadow_state):
        st.init_state(ADAMW, p, s)
    per_param = compiled._compile(compiled._step_body(ADAMW, st, False, False),
                                  f"test_per_parameter_{strategy}")
    cpu = torch.device("cpu")
    for step in range(1, 4):
        grads = _grads(step)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        assert opt.last_paths == {0: "compiled"}
        packed, static = compiled.pack(ADAMW, ADAMW.coefficients(opt.param_groups[0], step),
                                       cpu)
        for i in range(len(params)):
            uniforms = None
            if st.draws:  # keyed by (seed, position, step), indexed from 0
                key = draws.draw_key(opt.seed, i, step, 0, cpu)
                uniforms = draws.counter_uniform(params[i].numel(), key)
            flat = {k: v.view(-1) for k, v in shadow_state[i].items() if k != "step"}
            per_param(shadow[i].view(-1), grads[i].float().view(-1), flat, packed, static,
                      None, uniforms)
        for i, p in enumerate(params):
            assert torch.equal(p.detach(), shadow[i]), (strategy, step, i)
            for key, value in shadow_state[i].items():
                if key != "step":
                    assert torch.equal(opt.state[p][key], value), (strategy, step, i, key)


def test_fused_stays_close_to_foreach():
    """Fused vs foreach (eager): equal up to inductor's 1-ulp lerp rounding differences."""
    a, b = _params(), _params()
    oa = collage.AdamW(a, lr=1e-2, strategy="plus", foreach=True)
    ob = collage.AdamW(b, lr=1e-2, strategy="plus", fused=True)
    for step in range(5):
        for pa, pb, g in zip(a, b, _grads(step)):
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    st = get_strategy("plus")
    for pa, pb in zip(a, b):
        va = kernels.represented_value(st, pa, oa.state[pa])
        vb = kernels.represented_value(st, pb, ob.state[pb])
        # five steps of lr 1e-2: a 1-ulp bf16 difference in exp_avg moves w by < 1e-4
        assert (va - vb).abs().max() < 1e-4
        ulps = (oa.state[pa]["exp_avg"].float() - ob.state[pb]["exp_avg"].float()).abs()
        assert (ulps <= oa.state[pa]["exp_avg"].float().abs() * 2**-7 + 1e-30).all()


def test_in_kernel_stochastic_rounding_is_bitwise_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    n = 200_000
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38,
                             -3.3895e38, 3.4e38, 1e-40, -1e-40, 1e-45, -1e-45, 1.0, -1.0])
    x = torch.cat([bits.view(torch.float32), torch.randn(n, generator=g),
                   torch.randn(n, generator=g).bfloat16().float(), specials,
                   (torch.rand(n, generator=g) * 2 - 1) * 1e-38])
    draw = torch.rand(x.shape, generator=g)
    want = stochastic_round(x, torch.bfloat16, draw)
    got = _stochastic_round_bf16(x, draw)
    same = (want.view(torch.int16) == got.view(torch.int16)) | (want.isnan() & got.isnan())
    assert bool(same.all())


def test_counter_uniform_is_uniform_and_keyed():
    seeds = torch.tensor([12345, -678, 0], dtype=torch.int32)
    u = draws.counter_uniform(1 << 20, seeds)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 2e-3
    assert abs(float(u.var()) - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert float((counts / u.numel() - 1 / 16).abs().max()) < 2e-3
    assert torch.equal(u, draws.counter_uniform(1 << 20, seeds.clone()))
    other = draws.counter_uniform(1 << 20, torch.tensor([12346, -678, 0], dtype=torch.int32))
    # a shard starting at element 1000 draws what the whole tensor draws there
    shard = draws.counter_uniform(5000, torch.tensor([12345, -678, 1000], dtype=torch.int32))
    assert torch.equal(shard, u[1000:6000])
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 5e-3
    # neighbouring elements are not correlated either
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 5e-3


def test_stochastic_fused_rounding_is_unbiased():
    """E[w] follows the exact update: many tiny steps that round-to-nearest would lose."""
    p = torch.nn.Parameter(torch.ones(1 << 16, dtype=torch.bfloat16))
    # AdamW under a constant gradient steps by lr (m / sqrt(v) = 1): 2**-12 is a sixteenth
    # of bf16's spacing just below 1.0 (2**-8)...
    opt = collage.AdamW([p], lr=2.0**-12, weight_decay=0.0, strategy="stochastic",
                        fused=True)
    for _ in range(20):
        p.grad = torch.ones_like(p)
        opt.step()
    # ...20 steps move the mean by 20 * 2**-12 (nearest rounding would not move at all)
    assert abs(float(p.detach().float().mean()) - (1.0 - 20 * 2.0**-12)) < 2e-4
