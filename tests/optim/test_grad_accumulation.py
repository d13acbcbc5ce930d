"""``grad_accumulation="pair"`` (optim/backward.py ``GradSums``, docs/memory.md).

The gradients of N backward passes are summed in float32 by the optimizer, and step() uses
that sum rounded once to bf16. Every expected value here comes from the test's own
references: a float32 loop over the same bf16 gradients, and the exact sum in float64 (the
sum of at most 64 bf16 values whose exponents span less than 2**10 is exact in float64 for
the inputs below: each case states why).

Gradients are injected exactly: ``backward`` of ``(p * c).sum()`` gives ``p.grad == c`` bit
for bit (the product of ``c`` by the incoming 1).
"""

from __future__ import annotations

import math

import pytest
import torch

import collage

from ._common import BF16, assert_bitwise_equal, bits

N = 5  # parameter size


def _grads(case: str) -> list[torch.Tensor]:
    """Adversarial bf16 gradient sequences, each a list of N-element tensors."""
    g = torch.Generator().manual_seed(3)
    if case == "magnitude_gaps":  # 2**60 apart: bf16's 8 bits keep nothing of the small
        big = torch.full((N,), 2.0 ** 30)
        return [big] + [torch.full((N,), 2.0 ** -30) * (k + 1) for k in range(15)]
    if case == "cancellation":  # +big, small terms, -big: the sum is the small terms
        big = torch.randn(N, generator=g) * 1e4
        return [big] + [torch.randn(N, generator=g) for _ in range(14)] + [-big]
    if case == "tiny_into_large":  # 1, then 63 increments of 2**-10: each is below half
        # an ulp of 1 in bf16 (2**-8), so plain bf16 accumulation never moves
        return [torch.ones(N)] + [torch.full((N,), 2.0 ** -10)] * 63
    if case == "random_64":  # 64 micro-batches of gradients spanning 2**-20 .. 2**10
        return [torch.randn(N, generator=g) * 2.0 ** torch.randint(-20, 10, (N,),
                                                                  generator=g)
                for _ in range(64)]
    raise ValueError(case)


CASES = ("magnitude_gaps", "cancellation", "tiny_into_large", "random_64")


def _as_bf16(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.to(BF16) for x in grads]


def _accumulate(opt, p: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
    for c in grads:
        (p * c).sum().float().backward()


def _float32_loop(grads: list[torch.Tensor]) -> torch.Tensor:
    """The reference: the sequential float32 sum of the bf16 gradients."""
    total = torch.zeros(N, dtype=torch.float32)
    for c in grads:
        total = total + c.float()
    return total


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.linspace(-1, 1, N).to(BF16))


@pytest.mark.parametrize("case", CASES)
def test_sum_is_the_float32_sum(case):
    """The optimizer's sum is bit for bit the sequential float32 sum (hence within 2**-16
    relative of it, the issue's goal, with margin 0); p.grad is None between backwards."""
    grads = _as_bf16(_grads(case))
    p = _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    _accumulate(opt, p, grads)
    assert p.grad is None
    assert_bitwise_equal({"sum": opt.accumulated_grad(p)}, {"sum": _float32_loop(grads)})


@pytest.mark.parametrize("case", CASES)
def test_sum_against_exact(case):
    """Against the exact sum: ``math.fsum`` is the exact sum rounded once to float64
    (relative 2**-53, negligible against the bound, and added to it).

    Bound: recursive summation of n terms in a precision of unit roundoff u = 2**-24 errs by
    at most gamma_(n-1) * sum |g_k|, gamma_m = m u / (1 - m u) (Higham, Accuracy and
    Stability, eq. 4.4): the float32 sum's bound, met by the optimizer's sum."""
    grads = _as_bf16(_grads(case))
    p = _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    _accumulate(opt, p, grads)
    got = opt.accumulated_grad(p).double()
    columns = torch.stack([c.double() for c in grads]).T.tolist()
    exact = torch.tensor([math.fsum(col) for col in columns], dtype=torch.float64)
    magnitude = torch.stack([c.double().abs() for c in grads]).sum(0)
    m = len(grads) - 1
    gamma = m * 2.0 ** -24 / (1 - m * 2.0 ** -24)
    assert ((got - exact).abs() <= gamma * magnitude + 2.0 ** -53 * exact.abs()).all()


@pytest.mark.parametrize("case", ["tiny_into_large", "random_64"])
def test_plain_bf16_loses_what_the_sum_keeps(case):
    """The control: the same backward passes with plain accumulation (autograd adds in
    bf16) lose the small gradients (``tiny_into_large``: all 63 of them; ``random_64``:
    measured 2.6 % at worst); the pair keeps them (relative error to the exact sum: plain
    above 2**-9, one bf16 rounding; pair below 2**-16). With cancellation the float32 sum
    itself errs relative to the exact one: ``cancellation`` is bounded above, not here."""
    grads = _as_bf16(_grads(case))
    plain_p, pair_p = _param(), _param()
    collage.AdamW([plain_p], foreach=True)
    pair = collage.AdamW([pair_p], grad_accumulation="pair", foreach=True)
    _accumulate(None, plain_p, grads)
    _accumulate(pair, pair_p, grads)
    exact = torch.tensor([math.fsum(col) for col in
                          torch.stack([c.double() for c in grads]).T.tolist()])
    plain_error = ((plain_p.grad.double() - exact).abs() / exact.abs()).max()
    pair_error = ((pair.accumulated_grad(pair_p).double() - exact).abs() / exact.abs()).max()
    assert plain_error > 2.0 ** -9 and pair_error < 2.0 ** -16


@pytest.mark.parametrize("case", CASES)
def test_step_uses_the_sum_rounded_once(case):
    """N backwards then step() steps as a plain optimizer given p.grad = the float32
    sum rounded to bf16 once (bitwise: weights and states)."""
    grads = _as_bf16(_grads(case))
    p, p_ref = _param(), _param()
    opt = collage.AdamW([p], lr=1e-2, grad_accumulation="pair", foreach=True)
    ref = collage.AdamW([p_ref], lr=1e-2, foreach=True)
    _accumulate(opt, p, grads)
    opt.step()
    p_ref.grad = _float32_loop(grads).to(BF16)
    ref.step()
    assert torch.equal(bits(p.grad), bits(p_ref.grad))
    got = {"p": p.detach(), **{k: v for k, v in opt.state[p].items()}}
    want = {"p": p_ref.detach(), **{k: v for k, v in ref.state[p_ref].items()}}
    assert_bitwise_equal(got, want)


def test_repeated_cycles_and_zero_grad():
    """zero_grad drops the sum; a second accumulation starts from nothing, and a
    gradient left in p.grad from the last step (no zero_grad) is added as autograd adds
    into it, then moved into the sum."""
    p = _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    first = _as_bf16(_grads("cancellation"))
    _accumulate(opt, p, first)
    opt.zero_grad()
    assert opt.accumulated_grad(p) is None and p.grad is None
    second = _as_bf16(_grads("random_64"))[:4]
    _accumulate(opt, p, second)
    assert_bitwise_equal({"s": opt.accumulated_grad(p)}, {"s": _float32_loop(second)})
    opt.step()
    left = p.grad.clone()  # the rounded sum, left in p.grad by step() as torch leaves it
    (p * second[0]).sum().float().backward()  # autograd adds into it, in bf16
    assert_bitwise_equal({"s": opt.accumulated_grad(p)},
                         {"s": (left + second[0]).float()})


def test_signed_zeros():
    """-0 + -0 is -0 in float32 and stays -0 when rounded: the sign bit survives."""
    p = _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    negative_zero = torch.full((N,), -0.0, dtype=BF16)
    _accumulate(opt, p, [negative_zero, negative_zero])
    opt.write_grads()
    assert torch.equal(bits(p.grad), bits(negative_zero))


@pytest.mark.parametrize(("terms", "why"), [
    ([3.3895313892515355e38, 2.0 ** 119], "finite in float32, rounds to inf in bf16"),
    ([float("inf"), 1.0], "inf stays inf"),
    ([float("inf"), -float("inf")], "inf - inf is nan"),
])
def test_nonfinite_sum_reaches_the_check(terms, why):
    """A non-finite accumulated gradient is seen by the non-finite check: the step is
    skipped, weights unchanged. The first case: bf16's largest value plus half its ulp
    is a float32 value, a tie that rounds to even (2**128 = inf) in bf16."""
    p = _param()
    before = p.detach().clone()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    grads = [torch.tensor([t] + [1.0] * (N - 1)).to(BF16) for t in terms]
    assert all(torch.isfinite(g.float()).all() or math.isinf(t) for g, t in zip(grads, terms))
    _accumulate(opt, p, grads)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert opt.skipped_steps == 1 and torch.equal(bits(p.detach()), bits(before)), why


def test_clip_grad_norm_clips_the_sum():
    """clip_grad_norm_ writes the sums first, then clips as torch's clip_grad_norm_ clips
    the float32 sum rounded to bf16 (the reference: torch's function on a copy)."""
    grads = _as_bf16(_grads("random_64"))[:8]
    p = _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    _accumulate(opt, p, grads)
    norm = opt.clip_grad_norm_(0.5)
    twin = _param()
    twin.grad = _float32_loop(grads).to(BF16)
    want_norm = torch.nn.utils.clip_grad_norm_([twin], 0.5)
    assert want_norm > 0.5  # (the clipping changes the gradient)
    assert torch.equal(bits(norm), bits(want_norm))
    assert torch.equal(bits(p.grad), bits(twin.grad))


def test_grad_scaler_needs_write_grads():
    """GradScaler checks p.grad, which the pair keeps in the optimizer: refused with the fix;
    after write_grads() the scaler sees and unscales the sum."""
    p = _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for c in _as_bf16(_grads("random_64"))[:3]:
        scaler.scale((p * c).sum().float()).backward()
    with pytest.raises(RuntimeError, match=r"optimizer.write_grads\(\) before scaler.step"):
        scaler.step(opt)
    p2 = _param()
    opt2 = collage.AdamW([p2], grad_accumulation="pair", foreach=True)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=4.0)
    for c in _as_bf16(_grads("random_64"))[:3]:
        scaler2.scale((p2 * c).sum().float()).backward()
    opt2.write_grads()
    scaler2.step(opt2)
    assert not torch.equal(p2.detach(), _param().detach())


def test_state_dict_holds_no_sum():
    """The sums are gradients, not state: state_dict is a plain optimizer's, and loading
    one keeps a sum in progress."""
    p, q = _param(), _param()
    opt = collage.AdamW([p], grad_accumulation="pair", foreach=True)
    plain = collage.AdamW([q], foreach=True)
    for o, param in ((opt, p), (plain, q)):
        (param * torch.ones(N, dtype=BF16)).sum().float().backward()
        o.step()
    opt.zero_grad()
    (p * torch.ones(N, dtype=BF16)).sum().float().backward()
    saved = opt.state_dict()
    assert saved["state"].keys() == plain.state_dict()["state"].keys()
    assert saved["state"][0].keys() == plain.state_dict()["state"][0].keys()
    opt.load_state_dict(saved)
    assert torch.equal(opt.accumulated_grad(p), torch.ones(N))


def test_bad_value_lists_the_valid_ones():
    with pytest.raises(ValueError, match="grad_accumulation='pairs' is unknown; use one of: "
                                         "'plain', 'pair'"):
        collage.SGD([_param()], grad_accumulation="pairs")
