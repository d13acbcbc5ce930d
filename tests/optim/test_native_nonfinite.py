"""The native non-finite check (``native.any_nonfinite``, used by ``nonfinite="skip"`` and
``"raise"`` once the library is loaded): the verdict of ``torch.isfinite(t).all()`` for every
position of an inf or nan (vector body, tail, first and last element, thread cuts), both
dtypes, and the optimizer's skip and raise on top of it."""

from __future__ import annotations

import pytest
import torch

import collage
from collage.optim import native
from collage.optim import nonfinite as nonfinite_check

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

#: tails; in all above 2 x 262,144 elements (the check's CHECK_MIN_CHUNK): two threads
SIZES = (1, 31, 32, 33, 1000, 70_001, 140_003, 560_003)


def _cut_positions(n: int, offset: int) -> set[int]:
    """Positions in a tensor of ``n`` elements starting at ``offset`` (in the tensors laid
    end to end) beside the two threads' cut, the middle of all elements."""
    cut = sum(SIZES) // 2 - offset
    return {p for p in (cut - 1, cut, cut + 1) if 0 <= p < n}


def _tensors(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).mul_(1e30).to(dtype) for n in SIZES]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_verdict_is_torchs_for_every_position(dtype, threads) -> None:
    tensors = _tensors(dtype)
    assert native.any_nonfinite(tensors, threads=threads) is False
    # largest finite values and subnormals are finite
    edge = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max,
                         torch.finfo(dtype).tiny / 4, -0.0], dtype=dtype)
    assert native.any_nonfinite([edge], threads=threads) is False
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    for value in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        for t, offset in zip(tensors, offsets):
            for position in {0, t.numel() // 2, t.numel() - 1, min(t.numel() - 1, 65_600),
                             *_cut_positions(t.numel(), offset)}:
                original = t[position].clone()
                t[position] = value
                want = not bool(torch.isfinite(t).all())
                assert native.any_nonfinite(tensors, threads=threads) is want is True, \
                    (value, t.numel(), position)
                t[position] = original
    assert native.any_nonfinite(tensors, threads=threads) is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [3, 4, 5, 7, 8, 13, 151])
def test_every_position_of_the_interleaved_parts_and_the_rest(dtype, n) -> None:
    """The check reads a span as four interleaved parts and then the elements after them
    (``span_nonfinite``): an inf or a nan at every position of a tensor of ``n`` elements
    (parts of 0, 1, 3 and 37 elements; a rest of 0-3) is found, one thread; none where
    every element is finite."""
    gen = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=gen).mul_(1e30).to(dtype)
    assert native.any_nonfinite([t], threads=1) is False
    for value in (float("inf"), float("nan")):
        for position in range(n):
            original = t[position].clone()
            t[position] = value
            assert native.any_nonfinite([t], threads=1) is True, (value, n, position)
            t[position] = original


def test_other_tensors_are_left_to_torch() -> None:
    half = torch.ones(4, dtype=torch.float16)
    strided = torch.ones(8)[::2]
    assert native.any_nonfinite([half]) is None
    assert native.any_nonfinite([strided]) is None
    assert native.any_nonfinite([]) is False
    assert native.any_nonfinite([torch.ones(0)]) is False


def test_optimizer_skips_and_raises_with_the_native_check(monkeypatch) -> None:
    seen = []
    original = native.any_nonfinite

    def spy(tensors, *args, **kwargs):
        verdict = original(tensors, *args, **kwargs)
        seen.append(verdict)
        return verdict

    monkeypatch.setattr(nonfinite_check, "any_nonfinite", spy)  # the name the check calls
    p = torch.nn.Parameter(torch.randn(100).bfloat16())
    before = p.detach().clone()
    opt = collage.AdamW([p], strategy="plus", lr=0.1)
    p.grad = torch.ones(100, dtype=torch.bfloat16)
    p.grad[57] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped step"):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.skipped_steps == 1
    p.grad[57] = 1.0
    opt.step()
    assert not torch.equal(p.detach(), before)
    p.grad[3] = float("inf")
    raising = collage.AdamW([p], strategy="plus", lr=0.1, nonfinite="raise")
    with pytest.raises(FloatingPointError, match="nothing was updated"):
        raising.step()
    assert seen == [True, False, True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_verdict_is_torchs_for_every_exponent_and_bit_pattern(dtype) -> None:
    """The kernel's test on the magnitude's bit pattern (>= the exponent mask) against
    torch's verdict: every bf16 pattern; for float32 every exponent and sign with the
    mantissas at its edges (quiet and signalling nan payloads, the largest finite value)."""
    if dtype == torch.bfloat16:
        patterns = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
        values = patterns.view(torch.bfloat16)
    else:
        exponents = torch.arange(256, dtype=torch.int64) << 23
        mantissas = torch.tensor([0, 1, 2**21, 2**22, 2**22 + 1, 2**23 - 1], dtype=torch.int64)
        magnitudes = (exponents[:, None] | mantissas[None, :]).flatten()
        bits = torch.cat([magnitudes, magnitudes | 2**31])
        values = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(
            torch.float32)
    body = torch.ones(96, dtype=dtype)  # the pattern inside the vectorised loop's body
    want = ~torch.isfinite(values)
    for value, bad in zip(values, want.tolist()):
        body[45] = value
        assert native.any_nonfinite([body], threads=1) is bad, value.view(
            torch.int16 if dtype == torch.bfloat16 else torch.int32).item()
