"""The Triton kernels on a CUDA GPU (marker ``cuda``; skipped without one, and the NCCL cases
without two). ``benchmarks/gpu_check.sh`` runs them; ``docs/gpu.md`` lists them.

* compiled on the GPU, the kernels compute what the interpreter computes on CPU, bit for
  bit (the arithmetic is defined, not approximated: ``tl.sqrt_rn``, ``tl.div_rn``, explicit
  fused multiply-adds, no contraction);
* against torch's eager kernels on CUDA: SGD and Lion bit for bit; AdamW within one ulp,
  because eager CUDA divides by a Python scalar as a multiply by its float32 reciprocal
  (ATen's ``div_true_kernel_cuda``), where the kernels divide;
* ``step()`` never waits for the device (``torch.cuda.set_sync_debug_mode("error")``), and
  ``capturable=True`` steps are captured and replayed in a CUDA graph;
* the memory a step holds is the memory model's (``collage memory``), per strategy;
* DDP and FSDP2 over NCCL (two GPUs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import collage
from collage.optim import get_strategy
from collage.optim.triton import launch as launches
from collage.train.memory import bytes_per_param

from ._common import RULE_CASES, weight_dtype
from ._division import DIVISORS, SIGNIFICANDS, special_dividends

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(launches.triton is None, reason="Triton is not installed"),
]

COVERED = tuple(s for s in collage.STRATEGIES if get_strategy(s).native_code is not None)
# odd sizes, a 0-d and an empty tensor, one spanning several blocks with a tail, and an
# unaligned view (its own, unhinted launch)
SHAPES = ((33,), (7, 5), (), (0,), (1024,), (5_001,))
CUDA = torch.device("cuda")


def _params(dtype: torch.dtype, device: torch.device, seed: int = 7) -> list:
    g = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter((torch.randn(s, generator=g) * 3).to(dtype).to(device))
           for s in SHAPES]
    base = (torch.randn(1001, generator=g) * 3).to(dtype).to(device)
    out.append(torch.nn.Parameter(base[1:]))  # 2 bytes past an allocation: unaligned
    return out


def _run(rule, strategy: str, device: torch.device, flags: dict, steps: int = 3) -> dict:
    dtype = weight_dtype(strategy)
    params = _params(dtype, device)
    opt = rule.cls(params, strategy=strategy, nonfinite="ignore", seed=3, **flags,
                   **rule.kwargs)
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 10.0 ** (step - 3)).to(dtype).to(
                device)
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.5
    assert set(opt.last_paths.values()) == {"triton"}, opt.last_paths
    out = {f"p{i}": p.detach().cpu() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"s{i}/{k}": v.detach().cpu() for k, v in opt.state[p].items()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(kinds[t.element_size()])


def _assert_same_bits(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(_bits(a[key]), _bits(b[key])), \
            f"{key}: {int((_bits(a[key]) != _bits(b[key])).sum())} elements differ"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units in the last place between two float tensors of one
    dtype (the integer views of same-signed floats are ordered)."""
    if not a.is_floating_point():
        return 0 if torch.equal(a, b) else 1 << 30
    x, y = _bits(a).long(), _bits(b).long()
    return int((x - y).abs().max()) if x.numel() else 0


def _cases() -> list:
    return [pytest.param(rule, s, id=f"{rule}-{s}") for rule in RULE_CASES for s in COVERED]


@pytest.mark.parametrize(("rule", "strategy"), _cases())
def test_gpu_kernels_are_the_interpreted_kernels_bit_for_bit(rule, strategy, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # for the CPU run; CUDA compiles
    _assert_same_bits(_run(rule, strategy, CUDA, {}),
                      _run(rule, strategy, torch.device("cpu"), {"fused": "triton"}))


@pytest.mark.parametrize(("rule", "strategy"), _cases())
def test_gpu_kernels_against_torch_eager_on_cuda(rule, strategy):
    got = _run(rule, strategy, CUDA, {})
    eager = _eager(rule, strategy)
    if rule.name == "adamw":
        # eager CUDA divides by a Python number as a product with its float32 reciprocal:
        # the update may differ by an ulp of itself at each step. 16-bit components absorb
        # that (two of their ulps at most); float32 weights carry it, so they are compared
        # in units of the update's size (lr = 1e-2 halved each step: below 1e-2 * 2**-22)
        for key in got:
            if not got[key].is_floating_point():
                continue
            if got[key].element_size() == 2:
                assert _ulps(got[key], eager[key]) <= 2, key
            else:
                gap = (got[key].double() - eager[key].double()).abs().max()
                scale = got[key].double().abs().max() * 2.0**-20 + 1e-2 * 2.0**-20
                assert gap <= scale, (key, float(gap))
    else:
        _assert_same_bits(got, eager)


def _eager(rule, strategy: str) -> dict:
    """The foreach path on CUDA (its step runs eagerly; the path check is skipped)."""
    dtype = weight_dtype(strategy)
    params = _params(dtype, CUDA)
    opt = rule.cls(params, strategy=strategy, nonfinite="ignore", seed=3, foreach=True,
                   **rule.kwargs)
    g = torch.Generator().manual_seed(11)
    for step in range(3):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 10.0 ** (step - 3)).to(dtype).to(
                CUDA)
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.5
    out = {f"p{i}": p.detach().cpu() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"s{i}/{k}": v.detach().cpu() for k, v in opt.state[p].items()})
    return out


def test_hardware_fma_is_torch_s():
    module = launches.kernel_module(False)
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    a, b, c = (torch.randn(n, generator=g).to(CUDA) for _ in range(3))
    out = torch.empty_like(a)
    module.fma_probe[(n // 1024,)](a, b, c, out, n, EMULATE_FMA=False, BLOCK=1024)
    assert torch.equal(out.view(torch.int32), torch.addcmul(c, a, b).view(torch.int32))


def test_the_division_by_a_row_constant_is_cuda_s():
    """``kernels.arithmetic._div_by_row`` compiled (hardware fused multiply-adds, the
    reciprocal by ``div.rn``) against CUDA's IEEE division, bit for bit but a NaN's
    payload: every dividend significand for each of the C tests' divisors moved into
    (0, 1], and the dividends passed through."""
    module = launches.kernel_module(False)
    special = special_dividends()
    for b in DIVISORS:
        for x in (SIGNIFICANDS, special):
            x = x.to(CUDA)
            c = torch.full_like(x, b * 0.5)
            out = torch.empty_like(x)
            module.div_by_row_probe[(-(-x.numel() // 1024),)](x, c, out, x.numel(),
                                                               EMULATE_FMA=False,
                                                               BLOCK=1024)
            want = x / c
            # NaN: a GPU's division returns its canonical NaN, the kernel the dividend
            # (payload kept; the step's next addition makes it canonical there too)
            same = (out.view(torch.int32) == want.view(torch.int32)) | \
                (out.isnan() & want.isnan())
            assert bool(same.all()), b


@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("strategy", ["plus", "stochastic", "mixed"])
def test_step_never_waits_for_the_device(strategy, capturable, nonfinite):
    """The default check (``skip``) too: its verdict stays on the device, a nan step among
    them is skipped there, and ``skipped_steps`` reads the count afterwards."""
    params = _params(weight_dtype(strategy), CUDA)
    lr = torch.tensor(1e-3, device=CUDA) if capturable else 1e-3
    opt = collage.AdamW(params, lr=lr, strategy=strategy, nonfinite=nonfinite,
                        capturable=capturable)
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4):
            opt.step()
            bad = nonfinite == "skip" and step == 1
            for p in params:  # new gradients: their addresses move
                p.grad = torch.full_like(p, float("nan") if bad else 0.02)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert opt.last_paths == {0: "triton"}
    if nonfinite == "skip":
        with pytest.warns(RuntimeWarning, match="skipped 1 step"):
            assert opt.skipped_steps == 1
        assert all(float(opt.state[p]["step"]) == 3.0 for p in params)


def test_a_resumed_optimizer_waits_for_the_device_once():
    """load_state_dict puts the step counters on the device; the first step reads them
    back to the host (one wait), the next ones never wait."""
    params = _params(torch.bfloat16, CUDA)
    opt = collage.AdamW(params, strategy="plus", nonfinite="ignore")
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    resumed = collage.AdamW(params, strategy="plus", nonfinite="ignore")
    resumed.load_state_dict(opt.state_dict())
    resumed.step()  # the counters come back to the host here
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            resumed.step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert resumed.last_paths == {0: "triton"}


@pytest.mark.parametrize("strategy", ["plus", "stochastic", "split"])
def test_capturable_steps_replay_in_a_cuda_graph(strategy):
    dtype = weight_dtype(strategy)

    def setup():
        params = _params(dtype, CUDA)
        for p in params:
            p.grad = torch.zeros_like(p)
        lr = torch.tensor(1e-2, device=CUDA)
        opt = collage.Lion(params, lr=lr, strategy=strategy, nonfinite="ignore",
                           capturable=True, weight_decay=0.1)
        return params, opt, lr

    def grads(step: int, params: list) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        return [torch.randn(p.shape, generator=g).to(dtype).to(CUDA) for p in params]

    captured, opt, lr = setup()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(3):  # warm-up: states made, tables built, kernels compiled
            for p, grad in zip(captured, grads(step, captured)):
                p.grad.copy_(grad)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step in range(3, 8):
        for p, grad in zip(captured, grads(step, captured)):
            p.grad.copy_(grad)
        lr.fill_(1e-2 / step)  # a new learning rate, read by the replay
        graph.replay()
    torch.cuda.synchronize()

    stepped, eager_opt, eager_lr = setup()  # the same steps, run one by one
    for step in range(8):
        for p, grad in zip(stepped, grads(step, stepped)):
            p.grad.copy_(grad)
        if step >= 3:
            eager_lr.fill_(1e-2 / step)
        eager_opt.step()
    for p, q in zip(captured, stepped):
        assert torch.equal(_bits(p.detach()), _bits(q.detach()))


@pytest.mark.parametrize("strategy", COVERED)
def test_persistent_memory_is_the_memory_model(strategy):
    """What an AdamW step holds beyond the weights and gradients is the strategy's states
    (``collage memory``'s bytes per parameter), and its peak adds almost nothing."""
    dtype = weight_dtype(strategy)
    n = 1 << 24
    torch.cuda.empty_cache()
    params = [torch.nn.Parameter(torch.randn(n, device=CUDA).to(dtype)),
              torch.nn.Parameter(torch.randn(4097, device=CUDA).to(dtype))]
    for p in params:
        p.grad = torch.randn_like(p)
    total = sum(p.numel() for p in params)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt = collage.AdamW(params, strategy=strategy, nonfinite="ignore")
    opt.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    model = bytes_per_param(strategy)
    expected = (model.total - dtype.itemsize - model.gradients) * total
    slack = 2 << 20  # tables, counters, the allocator's rounding
    assert abs(held - expected) <= slack, (held / total, expected / total)
    assert peak - held <= slack, (peak, held)


WORKER = Path(__file__).with_name("_nccl_worker.py")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("task", ["ddp", "fsdp"])
def test_data_parallel_over_nccl(task, tmp_path):
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, str(WORKER), task, str(rank), "2", str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert all("OK" in out for out in outputs), outputs
