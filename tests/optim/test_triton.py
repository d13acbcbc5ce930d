"""The Triton kernels (optim/triton/, docs/gpu.md) on CPU, through Triton's interpreter.

Marked ``triton``: they set ``TRITON_INTERPRET=1`` for themselves (the kernels are loaded per
mode when launched, so this works in a process that imported collage without it) and run
in the default test run. Each compares ``fused="triton"`` with ``foreach=True`` bit for
bit: every rule x strategy the kernels cover, odd sizes, several tensors per launch (a 0-d
and an empty one among them, and one spanning several programs), GradScaler and
``maximize``, a new learning rate every step, fp16 weights, and ``capturable=True``.

Why the eager reference gets an IEEE square root: this torch build's CPU ``Tensor.sqrt`` for
float32 is not correctly rounded (about 20 % of random inputs are 1 ulp off; docs/gpu.md
says where it was measured), while the kernels compute
``tl.sqrt_rn``, as torch's CUDA kernels and the C kernels' ``sqrtf`` do. With the square
root the same operation on both sides, every result is the same bits.
"""

from __future__ import annotations

import io
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import collage
from collage.optim import compiled, dispatch, get_strategy, nonfinite
from collage.optim.triton import launch as launches
from collage.optim.triton import path as triton_path
from collage.optim.triton import plan as triton_plan

from ._common import RULE_CASES, RuleCase, assert_bitwise_equal, weight_dtype

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]

needs_triton = pytest.mark.skipif(launches.triton is None, reason="Triton is not installed")

# odd sizes, a 0-d and an empty tensor, one over INTERPRETED_BLOCK (several programs)
SHAPES = ((33,), (7, 5), (), (0,), (300,), (3, 1, 2))
#: every strategy the kernels land (plus8's 8-bit moments are not among them)
COVERED = tuple(s for s in collage.STRATEGIES if get_strategy(s).native_code is not None)
SGD_NESTEROV = RuleCase("sgd_nesterov", collage.SGD,
                        {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2})
SGD_PLAIN = RuleCase("sgd_plain", collage.SGD, {"lr": 5e-2})
RULES = (*RULE_CASES, SGD_NESTEROV, SGD_PLAIN)


_TORCH_SQRT = torch.Tensor.sqrt


def _ieee_sqrt(self: torch.Tensor) -> torch.Tensor:
    """A correctly rounded float32 square root: float64's (correctly rounded, 53 bits)
    rounded to float32 (double rounding is innocuous for sqrt: 53 >= 2 * 24 + 2)."""
    if self.dtype == torch.float32:
        return _TORCH_SQRT(self.double()).float()
    return _TORCH_SQRT(self)


@pytest.fixture
def ieee_sqrt(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "sqrt", _ieee_sqrt)


def _params(dtype: torch.dtype, seed: int = 7) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 3).to(dtype)) for s in SHAPES]


def _run(rule: RuleCase, strategy: str, flags: dict, *, dtype: torch.dtype | None = None,
         scale: float | None = None, maximize: bool = False, steps: int = 3,
         nonfinite: str = "ignore") -> tuple[dict, dict]:
    """``steps`` steps on SHAPES; returns every weight and state tensor, and the paths."""
    dtype = dtype or weight_dtype(strategy)
    params = _params(dtype)
    opt = rule.cls(params, strategy=strategy, maximize=maximize, nonfinite=nonfinite, seed=3,
                   **flags, **rule.kwargs)
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 10.0 ** (step - 3) * (scale or 1.0)
            p.grad = grad.to(dtype)
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
        opt.step()
        for group in opt.param_groups:  # a new learning rate every step
            group["lr"] *= 0.5
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"s{i}/{k}": v.detach().clone() for k, v in opt.state[p].items()})
    return out, dict(opt.last_paths)


def _cases(rules=RULES) -> list:
    return [pytest.param(rule, strategy, id=f"{rule}-{strategy}")
            for rule in rules for strategy in COVERED]


@needs_triton
@pytest.mark.parametrize(("rule", "strategy"), _cases())
def test_triton_is_the_foreach_kernel_bit_for_bit(rule, strategy, ieee_sqrt):
    got, paths = _run(rule, strategy, {"fused": "triton"})
    want, _ = _run(rule, strategy, {"foreach": True})
    assert paths == {0: "triton"}
    assert_bitwise_equal(got, want)


@needs_triton
@pytest.mark.parametrize("strategy", COVERED)
def test_scaled_maximized_steps_bit_for_bit(strategy, ieee_sqrt):
    rule = RULE_CASES[0]
    got, _ = _run(rule, strategy, {"fused": "triton"}, scale=1024.0, maximize=True)
    want, _ = _run(rule, strategy, {"foreach": True}, scale=1024.0, maximize=True)
    assert_bitwise_equal(got, want)


#: strategies that accept fp16 weights and round to nearest (stochastic: bf16 only)
FP16_STRATEGIES = tuple(s for s in COVERED if torch.float16 in get_strategy(s).weight_dtypes
                        and not get_strategy(s).draws)


@needs_triton
@pytest.mark.parametrize("rule", RULE_CASES, ids=str)
@pytest.mark.parametrize("strategy", FP16_STRATEGIES)
def test_fp16_weights_bit_for_bit(rule, strategy, ieee_sqrt):
    got, paths = _run(rule, strategy, {"fused": "triton"}, dtype=torch.float16)
    want, _ = _run(rule, strategy, {"foreach": True}, dtype=torch.float16)
    assert paths == {0: "triton"}
    assert_bitwise_equal(got, want)


@needs_triton
@pytest.mark.parametrize(("rule", "strategy"), _cases(RULE_CASES))
def test_capturable_is_the_foreach_kernel_bit_for_bit(rule, strategy, ieee_sqrt):
    """Counters read by the kernel, coefficients computed per row by torch operations
    (``Rule.step_coefficients``): on CPU the same float64 values as the host's."""
    got, paths = _run(rule, strategy, {"capturable": True}, scale=64.0)
    want, _ = _run(rule, strategy, {"foreach": True}, scale=64.0)
    assert paths == {0: "triton"}
    assert_bitwise_equal(got, want)


def _run_with_a_bad_step(rule: RuleCase, strategy: str, flags: dict, *, bad: int = 2,
                         steps: int = 4) -> tuple[dict, collage.optim.CollageOptimizer]:
    """``steps`` steps under the default ``nonfinite="skip"``, the ``bad``-th (from 0) with an
    inf in one gradient and a nan in another; every weight and state after, and the
    optimizer."""
    dtype = weight_dtype(strategy)
    params = _params(dtype)
    opt = rule.cls(params, strategy=strategy, seed=3, **flags, **rule.kwargs)
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 10.0 ** (step - 3)).to(dtype)
        if step == bad:
            params[0].grad.view(-1)[3] = float("inf")
            params[4].grad.view(-1)[-1] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the host's skip warns here
            opt.step()
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"s{i}/{k}": v.detach().cpu().clone() for k, v in opt.state[p].items()})
    return out, opt


@needs_triton
@pytest.mark.parametrize(("rule", "strategy"), [
    *_cases(RULE_CASES[:1]),
    *[pytest.param(rule, s, id=f"{rule}-{s}") for rule in RULES[1:] for s in ("plus", "bf16")]])
def test_the_default_check_skips_on_the_device_bit_for_bit(rule, strategy, ieee_sqrt):
    """``nonfinite="skip"`` (the default) on the Triton path: the verdict stays on the
    device, the kernels write nothing on a bad step, the step counters stay (advanced by
    1 - verdict), and the result is the host-checked foreach path's bit for bit; the
    skipped step is counted when ``skipped_steps`` is read."""
    got, opt = _run_with_a_bad_step(rule, strategy, {"fused": "triton"})
    want, ref = _run_with_a_bad_step(rule, strategy, {"foreach": True})
    assert opt.last_paths == {0: "triton"}
    assert opt._device_skips is not None  # the verdicts were left on the device
    assert_bitwise_equal(got, want)
    with pytest.warns(RuntimeWarning, match="skipped 1 step"):
        assert opt.skipped_steps == 1 == ref.skipped_steps
    assert opt.state_dict()["collage"]["skipped_steps"] == 1


def _planned_step_with(strategy: str, dtype: torch.dtype, where: int, value: float,
                       flags: dict, first_size: int = 1000
                       ) -> tuple[list[torch.Tensor], collage.optim.CollageOptimizer]:
    """Two tensors (``first_size`` elements, 1,000: three whole interpreted blocks and a
    tail; 37: a tail only); a first step, then a step whose gradient has ``value`` at flat
    position ``where`` of the two tensors' concatenation; the weights after, and the
    optimizer."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
              for n in (first_size, 37)]
    opt = collage.AdamW(params, strategy=strategy, **flags)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        if step == 1:
            first, second = params[0].grad, params[1].grad
            if where < first_size:
                first.view(-1)[where] = value
            else:
                second.view(-1)[where - first_size] = value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the host's skip warns here
            opt.step()
    return [p.detach().clone() for p in params], opt


@needs_triton
@pytest.mark.parametrize(("strategy", "dtype"), [("plus", torch.bfloat16),
                                                 ("fp32", torch.float32)])
@pytest.mark.parametrize(("where", "value"), [
    (0, float("inf")),  # the first element of a whole block
    (300, float("nan")),  # inside a block
    (767, float("inf")),  # the last element of the last whole block
    (999, float("-inf")),  # the last element of a tail
    (1036, float("nan")),  # the last element of a tensor that is a tail only
    (500, 3.0e38),  # finite: the largest magnitudes (bf16's max is 3.39e38)
    (768, -0.0),  # finite: a signed zero, at a block's start
    (1001, 1e-40),  # finite: a subnormal (float32; bf16 keeps it too)
])
def test_the_plans_check_kernel_finds_every_non_finite_element(strategy, dtype, where,
                                                               value, ieee_sqrt):
    """Issue #29: a planned step's default check is ``kernels.nonfinite_check`` over the
    step's own tiles. Every non-finite value, wherever it lies (a whole block's first
    element, a tail's last), skips the step (weights bitwise unchanged, one skip counted),
    and no finite value does (the result is the host-checked foreach path's, bit for
    bit)."""
    _check_skips_like_foreach(strategy, dtype, where, value, 1000, verdict_on_device=True)


def _check_skips_like_foreach(strategy: str, dtype: torch.dtype, where: int, value: float,
                              first_size: int, verdict_on_device: bool = False) -> None:
    """:func:`_planned_step_with` on the Triton plan and on the host-checked foreach path:
    the same weights bit for bit, one skip counted by both where ``value`` is not finite,
    none where it is. ``verdict_on_device``: also that the Triton step left its verdict on
    the device (checked before ``skipped_steps`` reads it back)."""
    finite = value == value and abs(value) != float("inf")
    got, opt = _planned_step_with(strategy, dtype, where, value, {"fused": "triton"},
                                  first_size)
    want, ref = _planned_step_with(strategy, dtype, where, value, {"foreach": True},
                                   first_size)
    assert opt.last_paths == {0: "triton"}
    if verdict_on_device:
        assert isinstance(opt._device_skips, torch.Tensor)
    for a, b in zip(got, want):
        assert_bitwise_equal({"w": a}, {"w": b})
    if finite:
        assert opt.skipped_steps == 0 == ref.skipped_steps
    else:
        with pytest.warns(RuntimeWarning, match="skipped 1 step"):
            assert opt.skipped_steps == 1 == ref.skipped_steps


_CHECK_PLACES = [
    (25 * 256 + 3, float("inf")),  # program 1's 9th block: its second group of blocks
    (59 * 256 + 255, float("nan")),  # the last whole block, in a group clamped past it
    (49 * 256 + 128, -1.0e-30),  # finite: program 1's 17th block, its third group
]


@needs_triton
@pytest.mark.parametrize(("strategy", "dtype", "where", "value"), [
    *[("plus", torch.bfloat16, where, value) for where, value in _CHECK_PLACES],
    # float32 gradients (another word test) in the clamped group by default; the other two
    # places run under -m slow (each case 5-15 s in the interpreter: the suite's budget)
    ("fp32", torch.float32, *_CHECK_PLACES[1]),
    *[pytest.param("fp32", torch.float32, where, value, marks=pytest.mark.slow)
      for where, value in (_CHECK_PLACES[0], _CHECK_PLACES[2])]])
def test_the_check_kernel_finds_a_non_finite_element_in_any_group_of_blocks(
        strategy, dtype, where, value, ieee_sqrt):
    """Issue #44: the check reads ``CHECK_TILES`` whole blocks per iteration of a program's
    loop (each group located one iteration ahead; a group past the last block reads that
    one again). 60 whole blocks over the interpreter's 3 programs: 20 each, three groups of
    8, the last clamped; a non-finite value in any of them skips the step, a finite one
    does not (the host-checked foreach path's bits either way)."""
    _check_skips_like_foreach(strategy, dtype, where, value, 60 * 256 + 100)


@needs_triton
@pytest.mark.parametrize("bad_group", [0, 1])
def test_a_planned_and_an_unplanned_group_share_one_device_verdict(bad_group, monkeypatch,
                                                                  ieee_sqrt):
    """Group 0 stepped by its plan (its gradients checked by the plan's kernel), group 1
    by the general path (a parameter was appended to it: checked by the multi-tensor
    max-norm, which writes the verdict before the kernel raises it): a NaN in either skips
    both groups, every weight bitwise unchanged, one skip counted."""
    g = torch.Generator().manual_seed(9)

    def param(n: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16))

    groups = [[param(300), param(40)], [param(50)]]
    opt = collage.AdamW([{"params": groups[0]}, {"params": groups[1]}], strategy="plus",
                        fused="triton")
    for _ in range(2):
        for p in groups[0] + groups[1]:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    opt.param_groups[1]["params"].append(param(20))
    every = opt.param_groups[0]["params"] + opt.param_groups[1]["params"]
    for p in every:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    opt.param_groups[bad_group]["params"][-1].grad.view(-1)[-1] = float("nan")
    before = [p.detach().clone() for p in every]
    planned = []
    real = dispatch.check_planned
    monkeypatch.setattr(dispatch, "check_planned",
                        lambda ready, found: planned.append(ready.group.items) or
                        real(ready, found))
    opt.step()
    assert len(planned) == 1 and len(planned[0]) == 2  # group 0, by its plan's kernel
    assert opt.last_paths == {0: "triton", 1: "triton"}
    for a, b in zip(before, every):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with pytest.warns(RuntimeWarning, match="skipped 1 step"):
        assert opt.skipped_steps == 1


def test_the_verdict_device_is_the_groups_one_device_or_none():
    """``nonfinite.verdict_device``: the device of every group's first parameter where
    they agree (groups without parameters aside), else None: a model split over two GPUs
    in one process gets its verdict on the host (a kernel cannot read a flag in another
    GPU's memory). Tensors on two devices exist here as CPU and meta ones."""
    def group(*tensors: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(items=[SimpleNamespace(param=t) for t in tensors])

    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert nonfinite.verdict_device([group(cpu), group(), group(cpu, meta)]) == cpu.device
    assert nonfinite.verdict_device([group(cpu), group(meta)]) is None
    assert nonfinite.verdict_device([group()]) is None


@needs_triton
def test_groups_on_two_devices_get_the_verdict_on_the_host(monkeypatch, ieee_sqrt):
    """Two groups whose parameters are on two devices, each as if its path read the
    verdict on its device (``dispatch.verdict_on_device`` made to say so): no verdict is
    left on the device, which one group's kernels could not read; the host's refuses the
    step with a NaN in the first group, every weight as it was, one skip counted on the
    host."""
    g = torch.Generator().manual_seed(4)
    here = [torch.nn.Parameter(torch.randn(40, generator=g).to(torch.bfloat16))]
    there = [torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16, device="meta"))]
    opt = collage.AdamW([{"params": here}, {"params": there}], strategy="plus",
                        fused="triton")
    monkeypatch.setattr(dispatch, "verdict_on_device", lambda group: True)
    here[0].grad = torch.full_like(here[0], float("nan"))
    there[0].grad = torch.zeros_like(there[0])
    before = here[0].detach().clone()
    with pytest.warns(RuntimeWarning, match="skipped step"):
        opt.step()
    assert opt._device_skips is None and opt.skipped_steps == 1
    assert torch.equal(before.view(torch.int16), here[0].detach().view(torch.int16))


@needs_triton
def test_a_step_with_the_verdict_on_the_device_never_reads_a_tensor_on_the_host(monkeypatch,
                                                                               ieee_sqrt):
    """What ``set_sync_debug_mode("error")`` checks on a GPU (test_triton_cuda.py), checked
    here on the interpreter: after the first step (which moves the counters), a default
    step reads no tensor's value on the host (no ``item``, ``bool``, ``float``, ``int``,
    ``tolist``), on a good step and on a bad one."""
    params = _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="plus", fused="triton")
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host during step()")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for bad in (False, True, False):
        for p in params:
            p.grad = torch.full_like(p, float("nan") if bad else 0.25)
        opt.step()
    monkeypatch.undo()
    assert opt.last_paths == {0: "triton"}
    with pytest.warns(RuntimeWarning, match="skipped 1 step"):
        assert opt.skipped_steps == 1
    assert all(float(opt.state[p]["step"]) == 3.0 for p in params)


@needs_triton
def test_capturable_with_the_default_check_skips_on_the_device(ieee_sqrt):
    got, opt = _run_with_a_bad_step(RULE_CASES[0], "light", {"capturable": True})
    want, _ = _run_with_a_bad_step(RULE_CASES[0], "light", {"foreach": True})
    assert_bitwise_equal(got, want)
    with pytest.warns(RuntimeWarning, match="skipped 1 step"):
        assert opt.skipped_steps == 1


@needs_triton
def test_stochastic_draws_are_every_other_path_s():
    """SGD with lr = 1 on weights near 1 and gradients near 2**-12: ``w - g`` is exact and
    rarely a bf16 value, so the result is the draws' alone (test_paths.py)."""
    def run(flags: dict, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(5)
        w = torch.nn.Parameter((1 + torch.rand(700, generator=g)).to(torch.bfloat16))
        opt = collage.SGD([w], lr=1.0, strategy="stochastic", seed=seed, **flags)
        for _ in range(3):
            w.grad = (torch.randn(700, generator=g) * 2.0**-12).to(torch.bfloat16)
            opt.step()
        return w.detach().view(torch.int16)

    for seed in (0, 123):
        assert torch.equal(run({"fused": "triton"}, seed), run({"foreach": True}, seed))
    assert not torch.equal(run({"fused": "triton"}, 0), run({"fused": "triton"}, 123))


class _CountedKernels:
    """The interpreted kernel module, each kernel call recorded as (kernel, WHOLE, TAILS)."""

    def __init__(self, module, calls: list) -> None:
        self.module, self.calls = module, calls

    def __getattr__(self, name: str):
        kernel = getattr(self.module, name)
        calls = self.calls

        class Counted:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    calls.append((name, kwargs["WHOLE"], kwargs["TAILS"]))
                    return kernel[grid](*args, **kwargs)
                return run
        return Counted()


@needs_triton
def test_a_default_planned_step_is_two_kernel_calls(monkeypatch, ieee_sqrt):
    """Issue #29: a bucket's whole blocks and tails share one launch (each a host cost on
    a GPU): a default planned step over tensors with both (300 elements: a whole
    interpreted block and a tail; the others tails only) is one check and one step kernel
    call, and gives the foreach path's bits."""
    calls = []
    counted = _CountedKernels(launches.kernel_module(True), calls)
    monkeypatch.setattr(launches, "kernel_module", lambda interpret: counted)
    params, shadow = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="plus", fused="triton")
    ref = collage.AdamW(shadow, strategy="plus", foreach=True)
    for step in range(3):
        for p, q in zip(params, shadow):
            p.grad = torch.full_like(p, 0.01 * (step + 1))
            q.grad = p.grad.clone()
        calls.clear()
        opt.step()
        ref.step()
    assert calls == [("nonfinite_check", True, True), ("multi_tensor_step", True, True)]
    for p, q in zip(params, shadow):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


@needs_triton
def test_one_launch_steps_every_tensor_and_the_table_is_kept(monkeypatch, ieee_sqrt):
    seen = []
    original = launches.launch

    def spy(launch, *args, **kwargs):
        seen.append(launch)
        return original(launch, *args, **kwargs)

    monkeypatch.setattr(launches, "launch", spy)
    params = _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="plus", fused="triton", nonfinite="ignore")
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (step + 1))  # new gradients: new addresses
        opt.step()
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]  # one launch a step, one table
    assert seen[0].table.shape[0] == len(SHAPES)
    assert seen[0].tiles == sum(-(-p.numel() // launches.INTERPRETED_BLOCK) for p in params)
    shadow = _params(torch.bfloat16)
    ref = collage.AdamW(shadow, strategy="plus", foreach=True, nonfinite="ignore")
    for step in range(3):
        for p in shadow:
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        ref.step()
    for p, q in zip(params, shadow):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


@needs_triton
def test_an_unaligned_tensor_gets_its_own_unhinted_launch(monkeypatch, ieee_sqrt):
    """A view 2 bytes into its storage cannot be loaded in 16-byte vectors: it is stepped
    by a launch of its own, without the alignment hint; the others keep theirs."""
    seen = []
    original = launches.launch

    def spy(launch, *args, **kwargs):
        seen.append(launch.aligned)
        return original(launch, *args, **kwargs)

    monkeypatch.setattr(launches, "launch", spy)

    def run(flags):
        g = torch.Generator().manual_seed(4)
        storage = torch.randn(301, generator=g).to(torch.bfloat16)
        params = [torch.nn.Parameter(torch.randn(40, generator=g).to(torch.bfloat16)),
                  torch.nn.Parameter(storage[1:])]
        opt = collage.AdamW(params, strategy="plus", nonfinite="ignore", **flags)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
        return params

    got, want = run({"fused": "triton"}), run({"foreach": True})
    assert sorted(seen) == [False, True]
    for p, q in zip(got, want):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


def _plan_run(edit, flags: dict) -> tuple[dict, list]:
    """Four AdamW steps (``nonfinite="ignore"`` unless ``flags`` say otherwise);
    ``edit(opt, step)`` runs before each; returns the weights and states, and the paths of
    the steps."""
    params = _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="stochastic", seed=9,
                        **{"nonfinite": "ignore", **flags})
    g = torch.Generator().manual_seed(12)
    paths = []
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        edit(opt, step)
        opt.step()
        paths.append(opt.last_paths[0])
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"s{i}/{k}": v.detach().clone() for k, v in opt.state[p].items()})
    return out, paths


def _set_counters(opt, step: int) -> None:
    if step == 2:  # a counter written by hand: the plan must not step over it
        for state in opt.state.values():
            state["step"].fill_(100.0)


@needs_triton
@pytest.mark.parametrize("nonfinite", ["ignore", "skip"])
def test_later_steps_follow_the_plan_and_leave_it_when_a_counter_is_written(
        monkeypatch, ieee_sqrt, nonfinite):
    """``ignore``: the counters on the host, one per tensor; ``skip`` (the default): on the
    device, the elements of one vector (``launch.gather_counters``): a write to any of them
    is seen by the vector's version counter."""
    built = []
    original = triton_plan.TritonPlan.build.__func__

    def spy(cls, *args, **kwargs):
        plan = original(cls, *args, **kwargs)
        built.append(plan is not None)
        return plan

    monkeypatch.setattr(triton_plan.TritonPlan, "build", classmethod(spy))
    got, paths = _plan_run(_set_counters, {"fused": "triton", "nonfinite": nonfinite})
    want, _ = _plan_run(_set_counters, {"foreach": True, "nonfinite": nonfinite})
    assert paths == ["triton"] * 4
    assert built == [True, True]  # steps 1 and 3 took the general path; 2 and 4 the plan
    assert_bitwise_equal(got, want)
    assert float(got["s0/step"]) == 102.0


def _replace_a_counter(opt, step: int) -> None:
    if step == 2:  # a new tensor, not a write: the plan's counters no longer are the state's
        state = next(iter(opt.state.values()))
        state["step"] = torch.tensor(50.0)


@needs_triton
@pytest.mark.parametrize("nonfinite", ["ignore", "skip"])
def test_a_counter_replaced_by_another_tensor_leaves_the_plan(ieee_sqrt, nonfinite):
    got, paths = _plan_run(_replace_a_counter, {"fused": "triton", "nonfinite": nonfinite})
    want, _ = _plan_run(_replace_a_counter, {"foreach": True, "nonfinite": nonfinite})
    assert paths == ["triton"] * 4
    assert_bitwise_equal(got, want)
    assert float(got["s0/step"]) == 52.0


def _device_plan_steps(count: int, steps: int = 4):
    """``count`` bf16 tensors of 40 elements under the default check, ``steps`` steps on the
    Triton path; the optimizer, its parameters, and the torch operations and launches of
    the last (planned) step."""
    g = torch.Generator().manual_seed(count)
    params = [torch.nn.Parameter(torch.randn(40, generator=g).to(torch.bfloat16))
              for _ in range(count)]
    opt = collage.AdamW(params, strategy="plus", fused="triton")
    for _ in range(steps - 1):
        for p in params:
            p.grad = torch.randn(40, generator=g).to(torch.bfloat16)
        opt.step()
    for p in params:
        p.grad = torch.randn(40, generator=g).to(torch.bfloat16)
    with _CountOperations() as counted:
        opt.step()
    return opt, params, counted.operations


class _CountOperations(TorchDispatchMode):
    """The torch operations run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.operations: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.operations[name] = self.operations.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@needs_triton
def test_a_planned_device_step_runs_the_same_operations_for_3_tensors_as_for_30(
        monkeypatch, ieee_sqrt):
    """Issue #29: the host's work of a planned step under the default check does not grow
    with the group's tensors: the check is the plan's kernels over its own tiles (the
    per-tensor check, ``nonfinite_flag``, is not called); the counters are the elements of
    one vector (each state's ``step`` a view of it), advanced by one operation; the
    coefficients' table is kept and only its counter-dependent columns written; the same
    torch operations run for 3 tensors as for 30 (no per-tensor ``_foreach`` list, no
    stack)."""
    checked = []
    real = collage.optim.nonfinite.nonfinite_flag
    monkeypatch.setattr(collage.optim.nonfinite, "nonfinite_flag",
                        lambda grads, **kw: checked.append(len(grads)) or real(grads, **kw))
    few_opt, few, few_ops = _device_plan_steps(3)
    checked.clear()
    many_opt, many, many_ops = _device_plan_steps(30)
    assert checked == [30]  # the first step only: the plan it made checks the next ones
    assert few_ops == many_ops  # the kernels' launches (interpreted) among them
    assert "aten._foreach_add_" not in many_ops and "aten._foreach_norm" not in many_ops
    assert "aten.stack" not in many_ops and "aten.full" not in many_ops
    for opt, params in ((few_opt, few), (many_opt, many)):
        vector = launches.counter_vector([opt.state[p]["step"] for p in params])
        assert vector is not None and vector.tolist() == [4.0] * len(params)
        assert opt.last_paths == {0: "triton"}


@pytest.mark.parametrize(("rule_name", "hyper"), [
    ("adamw", {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}),
    ("adamw", {"lr": 1e-3, "betas": (0.95, 0.95), "eps": 1e-6, "weight_decay": 0.0}),
    # a tensor lr: step_size and decay in float32 tensor arithmetic on both (torch.optim's
    # form); the device computed them in float64 (an ulp off in step_size at step 1; found
    # by audit, 2026-12-07)
    ("adamw", {"lr": torch.tensor(1e-2), "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.1}),
    ("lion", {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.01}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4,
             "nesterov": False}),
])
def test_the_device_coefficients_are_the_hosts_in_float32_at_every_step(rule_name, hyper):
    """The Triton path's device coefficients (``launch.DeviceCoefficients``: torch's
    float64 operations on the step counters, rounded once to float32) against the host's
    (the rule's Python floats, rounded once to float32: the kernels' arguments when the
    counters live on the host), steps 1 to 20,000, bit for bit; the table kept from step
    to step (a number column filled again only when it changes: here the learning rate's)
    gives the same as a new one. torch's float64
    ``pow`` differs from Python's in the last bit now and then, so this is the contract
    the device path relies on: a float32 difference needs a float64 value within an ulp of
    a float32 tie."""
    rule = collage.optim.rules.RULES[rule_name]
    group = collage.optim.group.GroupStep(rule, get_strategy("plus"), hyper, [])
    steps = torch.arange(1, 20_001, dtype=torch.float32)
    table = launches.DeviceCoefficients(len(steps), steps.device)
    earlier = collage.optim.group.GroupStep(rule, get_strategy("plus"),
                                            dict(hyper, lr=2 * hyper["lr"]), [])
    table.update(earlier, steps + 5)  # another step and learning rate: rewritten below
    got = table.update(group, steps)
    assert torch.equal(got, launches.device_coefficients(group, steps))
    want = torch.tensor([launches.step_arguments(rule, rule.coefficients(hyper, step))
                         for step in range(1, 20_001)], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_triton
def test_device_counters_survive_a_state_dict_round_trip(ieee_sqrt):
    """The counters' vector is saved as its elements' values: ``torch.save`` of the state
    dict, loaded into a new optimizer, continues bit for bit as the uninterrupted run."""
    def grads(params, step):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)

    params, copies = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="plus", fused="triton")
    for step in range(2):
        grads(params, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for p, q in zip(params, copies):
            q.copy_(p)
    resumed = collage.AdamW(copies, strategy="plus", fused="triton")
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    for step in range(2, 4):
        grads(params, step)
        grads(copies, step)
        opt.step()
        resumed.step()
    for p, q in zip(params, copies):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        for key, value in opt.state[p].items():
            assert torch.equal(value, resumed.state[q][key]), key


@needs_triton
def test_a_changed_flag_leaves_the_plan():
    def to_foreach(opt, step):
        if step == 2:
            opt.param_groups[0]["fused"] = None
            opt.param_groups[0]["foreach"] = True

    _, paths = _plan_run(to_foreach, {"fused": "triton"})
    assert paths == ["triton", "triton", "foreach", "foreach"]


@needs_triton
def test_a_moved_state_rebuilds_the_table(ieee_sqrt):
    """A state replaced by another tensor (load_state_dict, a conversion) is followed."""
    params = _params(torch.bfloat16)
    shadow = _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="light", fused="triton", nonfinite="ignore")
    ref = collage.AdamW(shadow, strategy="light", foreach=True, nonfinite="ignore")
    for step in range(3):
        for p, q in zip(params, shadow):
            p.grad = q.grad = torch.full_like(p, 0.01 * (step + 1))
        opt.step()
        ref.step()
        for p in params:
            state = opt.state[p]
            state["exp_avg"] = state["exp_avg"].clone()
    for p, q in zip(params, shadow):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))


@needs_triton
def test_tensors_the_kernels_cannot_take_run_eagerly_with_the_same_bits(ieee_sqrt):
    """A non-contiguous weight is stepped by the eager kernel, the others by the launch."""
    def run(flags):
        g = torch.Generator().manual_seed(2)
        params = [torch.nn.Parameter(torch.randn(6, 5, generator=g).to(torch.bfloat16).t()),
                  torch.nn.Parameter(torch.randn(40, generator=g).to(torch.bfloat16))]
        opt = collage.AdamW(params, strategy="plus", nonfinite="ignore", **flags)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
        return params, opt.last_paths

    got, paths = run({"fused": "triton"})
    want, _ = run({"foreach": True})
    assert paths == {0: "triton"} and not got[0].is_contiguous()
    for p, q in zip(got, want):
        assert torch.equal(p.contiguous().view(torch.int16), q.contiguous().view(torch.int16))


@needs_triton
@pytest.mark.parametrize("strategy", ["plus8", "feedback"])
def test_an_uncovered_strategy_falls_back_with_one_warning(monkeypatch, strategy):
    """The strategies docs/gpu.md says the kernels do not land (every one but these is in
    COVERED, and stepped by them above)."""
    assert set(collage.STRATEGIES) - set(COVERED) == {"plus8", "feedback"}
    monkeypatch.setattr(compiled, "available", lambda: False)  # nothing to compile here
    params = _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy=strategy, fused="triton", nonfinite="ignore")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and strategy in messages[0], messages
    assert opt.last_paths == {0: "foreach"}


def test_cpu_tensors_without_the_interpreter_run_what_fused_true_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    params = _params(torch.bfloat16)
    opt = collage.AdamW(params, strategy="plus", fused="triton", nonfinite="ignore")
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.warns(RuntimeWarning, match="fused='triton'"):
        opt.step()
    assert opt.last_paths[0] != "triton"  # the native kernels, where they build


def test_without_triton_the_dispatch_falls_back(monkeypatch):
    monkeypatch.setattr(launches, "triton", None)
    assert not triton_path.available(torch.device("cuda"))
    group = collage.optim.group.GroupStep(
        collage.optim.rules.ADAMW, get_strategy("plus"), {}, [], fused="triton")
    warned = []
    group.warn = warned.append
    monkeypatch.setattr(compiled, "available", lambda: True)
    assert dispatch.choose(group, torch.device("cuda")) == "compiled"
    assert warned and "Triton is not installed" in warned[0]


@pytest.mark.parametrize(("flags", "match"), [
    ({"foreach": True}, "foreach"),
    ({"reference": True}, "reference"),
    ({"fused": False}, "fused"),
    ({"track_updates": True, "nonfinite": "ignore"}, "track_updates"),
    ({"nonfinite": "raise"}, "nonfinite='skip'"),
])
def test_capturable_refuses_what_would_synchronise(flags, match):
    params = _params(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        collage.AdamW(params, capturable=True, **{"nonfinite": "ignore", **flags})


def test_fused_accepts_triton_and_nothing_else():
    params = _params(torch.bfloat16)
    collage.Lion(params, fused="triton")
    with pytest.raises(TypeError, match="'triton'"):
        collage.Lion(params, fused="cuda")
