"""Issue #3, criterion 1: ``fp32`` is torch.optim, and ``mixed``'s master is torch.optim's
fp32 run fed the same (upcast) gradients.

Tolerance: "1e-6 relative" is measured per tensor as ``max|a - b| / max|a|`` (an elementwise
ratio is meaningless for weights that pass near zero). 1e-6 is about 16 float32 ulps of the
largest weight: room for a differently contracted multiply-add on every one of the 100 steps
(one ulp each) to be amplified by the training dynamics, while any algorithmic difference
(bias correction, decay order, eps placement) moves weights by far more than that.
Bitwise equality is asserted as well: the ``fp32`` strategy is documented as identical to
torch.optim (strategies.py: "plain add (identical to torch.optim)").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import collage

from ._common import BF16, FP32, PATHS, bits, make_mlp, loss_of

STEPS = 100
REL_TOL = 1e-6


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).abs().max() / a64.abs().max())


def _run_pair(model_a, opt_a, model_b, opt_b, steps: int = STEPS) -> None:
    for step in range(steps):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()


def _assert_match(model_a, model_b, *, bitwise: bool) -> None:
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert a.dtype == b.dtype == FP32
        rel = _relative_difference(a, b)
        assert rel <= REL_TOL, f"{name}: relative difference {rel:.3e} > {REL_TOL}"
        if bitwise:
            diff = int((bits(a) != bits(b)).sum())
            assert diff == 0, f"{name}: {diff} of {a.numel()} elements differ (rel {rel:.2e})"


@dataclass(frozen=True)
class TorchCase:
    """A collage optimizer and the torch.optim optimizer it must reproduce."""

    name: str
    ours: type
    theirs: type
    kwargs: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


ADAMW_CASES = (
    TorchCase("adamw", collage.AdamW, torch.optim.AdamW,
              {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}),
    TorchCase("adamw_no_wd", collage.AdamW, torch.optim.AdamW,
              {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}),
)
SGD_CASES = (
    TorchCase("sgd_plain", collage.SGD, torch.optim.SGD, {"lr": 0.05}),
    TorchCase("sgd_momentum", collage.SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    TorchCase("sgd_nesterov", collage.SGD, torch.optim.SGD,
              {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    TorchCase("sgd_dampening", collage.SGD, torch.optim.SGD,
              {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}),
    TorchCase("sgd_weight_decay", collage.SGD, torch.optim.SGD,
              {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}),
    TorchCase("sgd_nesterov_weight_decay", collage.SGD, torch.optim.SGD,
              {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
)


def _fp32_pair(case: TorchCase, path: str):
    model_a, model_b = make_mlp(FP32), make_mlp(FP32)
    # foreach=False: torch's single-tensor implementation, the one the fast kernel mirrors
    # (on CPU torch would pick it anyway).
    opt_a = case.theirs(model_a.parameters(), foreach=False, **case.kwargs)
    opt_b = case.ours(model_b.parameters(), strategy="fp32", **PATHS[path], **case.kwargs)
    return model_a, opt_a, model_b, opt_b


# the reference path is the research code's AdamW (its own eps placement and step size):
# tests/optim/test_research.py compares it with that code's arithmetic
@pytest.mark.parametrize("path", ["per_tensor", "foreach"])
@pytest.mark.parametrize("case", ADAMW_CASES, ids=str)
def test_fp32_adamw_is_torch_adamw(case: TorchCase, path: str) -> None:
    model_a, opt_a, model_b, opt_b = _fp32_pair(case, path)
    _run_pair(model_a, opt_a, model_b, opt_b)
    _assert_match(model_a, model_b, bitwise=True)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(bits(opt_a.state[pa][key]), bits(opt_b.state[pb][key])), key


def test_fp32_adamw_fused_within_1e6_of_torch() -> None:
    """The compiled kernel may contract a multiply-add into an fma (one rounding fewer), so
    only the 1e-6 statement is claimed for it."""
    model_a, opt_a, model_b, opt_b = _fp32_pair(ADAMW_CASES[0], "fused")
    _run_pair(model_a, opt_a, model_b, opt_b)
    _assert_match(model_a, model_b, bitwise=False)


# foreach only: the reference path is the research code's SGD (the update formed, then
# added: two roundings where torch fuses one multiply-add, and so does its weight decay),
# which drifts from torch by more than this bound on some CPUs (1.2e-6 after 100 steps with
# weight decay on this Xeon); tests/test_docs_claims.py checks it bit for bit against that
# formula instead (test_fp32_sgd_reference_forms_the_update_before_the_add)
@pytest.mark.parametrize("path", ["foreach"])
@pytest.mark.parametrize("case", SGD_CASES, ids=str)
def test_fp32_sgd_within_1e6_of_torch_sgd(case: TorchCase, path: str) -> None:
    model_a, opt_a, model_b, opt_b = _fp32_pair(case, path)
    _run_pair(model_a, opt_a, model_b, opt_b)
    _assert_match(model_a, model_b, bitwise=False)


@pytest.mark.parametrize("case", SGD_CASES, ids=str)
def test_fp32_sgd_first_step_is_bitwise_torch_sgd(case: TorchCase) -> None:
    """fp32 is documented as identical to torch.optim; one step on a large random tensor
    exposes any difference in rounding (torch's ``add_(x, alpha=a)`` is one fused
    multiply-add on CPU and CUDA, ``w + x * a`` rounds twice)."""
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(4096, generator=g)
    grads = [torch.randn(4096, generator=g) for _ in range(2)]
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_a = case.theirs([a], foreach=False, **case.kwargs)
    opt_b = case.ours([b], strategy="fp32", foreach=True, **case.kwargs)
    for grad in grads:  # two steps: the first initialises the momentum buffer
        a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
        diff = int((bits(a) != bits(b)).sum())
        assert diff == 0, f"{diff} of {a.numel()} weights differ from torch.optim.SGD"


@pytest.mark.parametrize("path", ["per_tensor", "foreach", "fused"])
def test_mixed_master_is_torch_adamw_on_fp32_copy(path: str) -> None:
    """bf16 model + ``mixed``: the fp32 master must be exactly what torch.optim.AdamW makes of
    an fp32 copy of the model fed the bf16 gradients upcast (exact), and the bf16 weights
    must be that master rounded to nearest."""
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    model = make_mlp(BF16)
    copy = make_mlp(FP32)
    with torch.no_grad():
        for c, p in zip(copy.parameters(), model.parameters()):
            c.copy_(p.float())  # exact: the master starts as the bf16 weight
    opt = collage.AdamW(model.parameters(), strategy="mixed", **PATHS[path], **kwargs)
    torch_opt = torch.optim.AdamW(copy.parameters(), foreach=False, **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step).backward()
        for c, p in zip(copy.parameters(), model.parameters()):
            c.grad = p.grad.float()
        opt.step()
        torch_opt.step()
    for (name, p), c in zip(model.named_parameters(), copy.parameters()):
        master = opt.state[p]["master"]
        assert master.dtype == FP32
        rel = _relative_difference(c, master)
        assert rel <= REL_TOL, f"{name}: master differs by {rel:.3e}"
        if path != "fused":  # eager float32: same operations as torch, so bit for bit
            assert torch.equal(bits(master), bits(c)), name
        assert torch.equal(bits(p.detach()), bits(master.to(BF16))), name


def _one_tensor_run(case: TorchCase, lr, path: str, steps: int = 5) -> tuple:
    """``steps`` steps of torch's optimizer (its default implementation: single-tensor on
    CPU, as it is for a tensor ``lr``) and ours on one large random float32 tensor."""
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(4096, generator=g)
    grads = [torch.randn(4096, generator=g) for _ in range(steps)]
    kwargs = {**case.kwargs, "lr": lr}
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_a = case.theirs([a], **kwargs)
    opt_b = case.ours([b], strategy="fp32", **PATHS[path], **kwargs)
    for grad in grads:
        a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    return a, b


@pytest.mark.parametrize("path", ["per_tensor", "foreach"])
@pytest.mark.parametrize("case", ADAMW_CASES + SGD_CASES[4:5], ids=str)
def test_fp32_with_a_tensor_lr_is_torch_bit_for_bit(case: TorchCase, path: str) -> None:
    """A 0-d tensor ``lr``: torch computes ``1 - lr * wd`` and ``lr / (1 - beta1**t)`` as
    float32 tensor operations (a float ``lr``: float64, rounded once); ours the same
    (issue #30, item 5: 4 % of weights were 1 ulp off at lr = 1e-2)."""
    for lr in (1e-2, 3e-3, 0.05):
        a, b = _one_tensor_run(case, torch.tensor(lr), path)
        diff = int((bits(a) != bits(b)).sum())
        assert diff == 0, f"lr={lr}: {diff} of {a.numel()} weights differ from torch"


def test_fp32_with_a_tensor_lr_fused_within_1e6_of_torch() -> None:
    """The fused path's stated bound (its multiply-adds may be contracted) holds with a
    tensor ``lr`` as with a float."""
    a, b = _one_tensor_run(ADAMW_CASES[0], torch.tensor(1e-2), "fused")
    assert _relative_difference(a, b) <= REL_TOL
