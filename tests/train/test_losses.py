"""collage.train.losses.cross_entropy against a float64 reference.

Tolerances: the loss is computed in float32 (``lse - x[target]``, the log-sum-exp a
float32 reduction): its error against float64 is a few float32 ulps of the log-sum-exp's
magnitude, bounded here by 1e-5 relative to (|lse| + 1) over a few hundred terms. The
float32 gradient (softmax - one-hot, scaled) is then rounded once to the logits' dtype:
for bf16 logits it must be the float64 gradient rounded to bf16 except where that value
lies within float32 error of a bf16 rounding boundary, i.e. within 1 bf16 ulp everywhere
and equal almost everywhere (checked: at most 1 % of elements differ, each by one ulp).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from collage.train.losses import cross_entropy


def reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
              reduction: str = "mean"):
    """Loss and gradient in float64 by the textbook formula."""
    x = logits.detach().double().reshape(-1, logits.shape[-1]).requires_grad_()
    t = target.reshape(-1)
    valid = t != ignore_index
    logp = x - torch.logsumexp(x, dim=1, keepdim=True)
    picked = logp.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    losses = torch.where(valid, -picked, torch.zeros_like(picked))
    if reduction == "mean":
        loss = losses.sum() / valid.sum()
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), grad.reshape(logits.shape)


def logits_and_target(rows=96, classes=257, dtype=torch.bfloat16, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, classes, generator=g) * scale).to(dtype)
    target = torch.randint(0, classes, (rows,), generator=g)
    return logits, target


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors of the same sign pattern."""
    def ordered(x):
        bits = x.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_elements", [1 << 20, 1000, 1])
def test_bf16_loss_and_gradient_match_float64(reduction, chunk_elements):
    logits, target = logits_and_target()
    target[::5] = -100
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction=reduction, chunk_elements=chunk_elements)
    want_loss, want_grad = reference(logits, target, reduction=reduction)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert loss.shape == want_loss.shape
    lse = torch.logsumexp(logits.double(), 1).abs().max()
    terms = 1 if reduction == "none" else target.numel()
    assert torch.allclose(loss.double(), want_loss, rtol=0, atol=1e-5 * (lse + 1) * terms ** 0.5)
    rounded = want_grad.to(torch.bfloat16)
    distance = ulps_bf16(x.grad, rounded)
    assert int(distance.max()) <= 1
    assert float((distance > 0).float().mean()) <= 0.01
    assert torch.all(x.grad[::5] == 0)  # ignored rows


def test_float32_logits_match_torch_and_float64():
    logits, target = logits_and_target(dtype=torch.float32)
    x = logits.clone().requires_grad_()
    y = logits.clone().requires_grad_()
    ours = cross_entropy(x, target)
    theirs = F.cross_entropy(y, target)
    ours.backward()
    theirs.backward()
    want_loss, want_grad = reference(logits, target)
    assert abs(ours.item() - float(want_loss)) <= 4 * abs(theirs.item() - float(want_loss)) + 1e-6
    # float32 gradients of size ~1/(rows*classes): a few float32 ulps of their magnitude
    assert torch.allclose(x.grad.double(), want_grad, rtol=1e-5, atol=1e-10)
    assert logits.equal(x.detach())  # float32 logits are read, never written


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_targets_are_the_int64_ones(dtype):
    """The byte corpus's tokens are uint8 (BPE's int16): the same loss and gradient as the
    int64 targets, bit for bit (they raised inside gather)."""
    logits, target = logits_and_target(classes=200)
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    narrow, wide = cross_entropy(x, target.to(dtype)), cross_entropy(y, target)
    narrow.backward()
    wide.backward()
    assert torch.equal(narrow, wide) and torch.equal(x.grad, y.grad)


def test_float64_logits_compute_in_float64():
    logits, target = logits_and_target(dtype=torch.float64)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target)
    loss.backward()
    want_loss, want_grad = reference(logits, target)
    assert loss.dtype == torch.float64
    assert torch.allclose(loss, want_loss, rtol=1e-13)
    assert torch.allclose(x.grad, want_grad, rtol=1e-12, atol=1e-18)


def test_batched_shape_and_huge_magnitude_gaps():
    """(B, T, V) logits as models return them; a row with one logit far above the rest
    (softmax ~ one-hot: its gradient entries are ~0 and ~-1/N, no overflow) and -inf logits
    (masked classes: zero probability, zero gradient)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 8, 33, generator=g).to(torch.bfloat16)
    logits[0, 0, 3] = 3.0e4
    logits[1, 2, :10] = float("-inf")
    target = torch.randint(10, 33, (2, 8), generator=g)
    target[0, 0] = 3
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target)
    loss.backward()
    want_loss, want_grad = reference(logits, target)
    assert torch.isfinite(loss) and abs(loss.item() - float(want_loss)) < 1e-4
    assert torch.all(x.grad[1, 2, :10] == 0)
    assert int(ulps_bf16(x.grad, want_grad.to(torch.bfloat16)).max()) <= 1


def test_nonfinite_logits_give_a_nonfinite_loss():
    """Never a finite wrong value: +inf on another class makes the target's probability 0
    (loss +inf, where torch's log-softmax says nan: inf - inf), +inf on the target itself
    is inf - inf = nan, a nan logit gives nan; rows without one are untouched."""
    logits, target = logits_and_target(rows=4, classes=5, dtype=torch.float32)
    target[:3] = 0
    logits[0, 2] = float("inf")
    logits[1, 0] = float("inf")
    logits[2, 4] = float("nan")
    ours = cross_entropy(logits, target, reduction="none")
    theirs = F.cross_entropy(logits, target, reduction="none")
    assert float(ours[0]) == float("inf")
    assert bool(ours[1].isnan()) and bool(ours[2].isnan())
    # lse - x[target] cancels to 0.06 here: a few float32 ulps of lse (~4), absolutely
    assert torch.allclose(ours[3], theirs[3], rtol=0, atol=4e-6) and torch.isfinite(ours[3])


def test_every_target_ignored_gives_nan_mean_and_zero_gradient():
    logits, target = logits_and_target(rows=4, classes=5)
    target[:] = -100
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target)
    assert bool(loss.isnan()) and bool(F.cross_entropy(logits.float(), target).isnan())
    assert float(cross_entropy(logits, target, reduction="sum")) == 0.0
    loss.backward()  # every row is ignored: its scale (1 / 0 = inf) is masked to 0
    assert torch.all(x.grad == 0)


def test_saves_no_float32_copy_of_the_logits():
    """What backward keeps: the logits themselves (no copy) and per-row vectors; torch's
    float32 recipe keeps a float32 (N, V) log-softmax (the point of this loss)."""
    logits, target = logits_and_target(rows=64, classes=300)
    x = logits.clone().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(x, target)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
    assert sum(t.numel() * t.element_size() for t in saved if t is not big[0]) <= 64 * 8 * 3
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(x.float(), target)
    assert any(t.dtype == torch.float32 and t.numel() == x.numel() for t in saved)


@pytest.mark.parametrize("bad, message", [
    (dict(reduction="avg"), "reduction='avg'"),
    (dict(chunk_elements=0), "chunk_elements=0"),
])
def test_bad_arguments_are_named(bad, message):
    logits, target = logits_and_target(rows=4, classes=5)
    with pytest.raises(ValueError, match=message):
        cross_entropy(logits, target, **bad)


def test_bad_inputs_are_named():
    logits, target = logits_and_target(rows=4, classes=5)
    with pytest.raises(ValueError, match="target's shape"):
        cross_entropy(logits, target[:3])
    with pytest.raises(TypeError, match="integer class indices"):
        cross_entropy(logits, target.float())
    with pytest.raises(TypeError, match="floating"):
        cross_entropy(target[:, None].expand(4, 5), target)
    target[2] = 5
    with pytest.raises(IndexError, match="target holds 5, outside the 5 classes"):
        cross_entropy(logits, target)
    target[2] = -1
    with pytest.raises(IndexError, match="target holds -1"):
        cross_entropy(logits, target)
    target[2] = -1
    assert torch.isfinite(cross_entropy(logits, target, ignore_index=-1))
