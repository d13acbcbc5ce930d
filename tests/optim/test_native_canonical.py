"""The residual landing keeps pairs canonical without normalising every pair (#31).

``light`` and ``plus`` land the new weight ``x`` (float32) as ``hi = RN(x)``, ``lo =
RN(x - hi)``, and ``plus`` and ``split`` keep their second moment the same way; every path
then normalises the pair (issue #25). docs/strategies.md ("Canonical by construction")
proves that the normalisation changes such a pair only where ``hi`` is odd and ``lo`` a
nonzero power of two (a tie beside an odd ``hi``), or ``hi`` is -0, provided no value is
NaN or subnormal (the kernels' fast roundings flag those blocks and redo them exactly,
normalising every pair). The kernels normalise only blocks holding such a lane. The vector
source of the other CPUs (step_vector.h, AVX2 and NEON) tests instead whether RN(hi + lo)
is hi in every lane (hi + lo is exact for these pairs, so its rest is lo then, but for a
-0 lo, which it makes +0): the exact pairs of the last test, on every backend this CPU
runs (conftest.kernel_lib).

These tests check, bit for bit, against an exact reference computed here in float64 (not
by the code under test): every 16-bit low half under the high halves where rounding is
hardest, both signs, on the kernels' 32-wide and 16-wide paths and the scalar tail:

* the claim: wherever the normalisation changes a pair, the cheap test holds (and the
  normalisation is needed: some pairs change, so it is not dropped altogether);
* the kernels' pairs are the exact canonical pairs.
"""

from __future__ import annotations

import pytest
import torch

import collage

from ._common import bits

BF16 = torch.bfloat16
F64 = torch.float64

#: high halves where rounding is hardest: zero and the subnormals, the smallest normals
#: (whose half gap is subnormal), the binade where it becomes normal (exponent field 9),
#: 1.0, its odd neighbour, the odd value below 2.0 (its carry reaches a power of two), the
#: largest finite values (the odd one's carry overflows), infinity
HIGHS = (0x0000, 0x0001, 0x007F, 0x0080, 0x0081, 0x0100, 0x0101, 0x0480, 0x0481, 0x3F80,
         0x3F81, 0x3FFF, 0x4000, 0x7F7E, 0x7F7F, 0x7F80)


def _inputs() -> torch.Tensor:
    """float32 values: every low half under each high half, both signs; no NaN (the
    kernels' NaN bits are ``test_native.py``'s), and a tail of 7 for the scalar loop."""
    highs = torch.tensor(HIGHS, dtype=torch.int64)
    lows = torch.arange(1 << 16, dtype=torch.int64)
    words = ((highs[:, None] << 16) | lows[None, :]).reshape(-1)
    words = torch.cat([words, words | (1 << 31)])
    x = (words - ((words >> 31) << 32)).to(torch.int32).view(torch.float32)
    x = x[~x.isnan()]
    tail = torch.tensor([1.0 + 2.0**-8 - 2.0**-23, -0.0, 0.0, 1e-40, 3.0, -5.5, 2.0**-126])
    return torch.cat([x, tail]).contiguous()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values that float32 holds exactly to bf16 (nearest, ties to even)."""
    return x.to(torch.float32).to(BF16)


def _landing(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair before normalisation: hi = RN(x), lo = RN(x - hi), +0 where hi is not
    finite; x - hi exact in float64."""
    hi = x.to(BF16)
    rest = x.double() - hi.double()
    lo = torch.where(torch.isfinite(hi), _bf16(rest), torch.zeros_like(hi))
    return hi, lo


def _canonical(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact canonical pair of hi + lo: the nearest bf16 of the exact sum (float64 holds
    it: two bf16 values), the exact rest (+0 where the nearest is not finite). Float64
    arithmetic follows IEEE's signed zeros: (-0) + (+0) = +0."""
    total = hi.double() + lo.double()
    nearest = _bf16(total)
    rest = total - nearest.double()
    return nearest, torch.where(torch.isfinite(nearest), _bf16(rest), torch.zeros_like(lo))


def _maybe_not_canonical(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The kernels' cheap test (``v_maybe_not_canonical``), on the 16-bit patterns."""
    h, l = bits(hi).to(torch.int32) & 0xFFFF, bits(lo).to(torch.int32) & 0xFFFF
    tie = ((h & 1) == 1) & ((l & 0x7F) == 0) & ((l & 0x7FFF) != 0)
    return tie | (h == 0x8000)


def _fast(x: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Where the kernels' fast roundings flag nothing: x and x - hi are zero or normal
    (not subnormal, not NaN; an infinite x or one rounding to infinity gives x - hi = NaN or
    infinity on the 32-wide path: flagged too)."""
    rest = x.double() - hi.double()

    def zero_or_normal(v):
        return (v == 0) | ((v.abs() >= 2.0**-126) & torch.isfinite(v))

    return zero_or_normal(x.double()) & zero_or_normal(rest) & torch.isfinite(hi)


def test_the_cheap_test_finds_every_pair_the_normalisation_changes() -> None:
    x = _inputs()
    hi0, lo0 = _landing(x)
    hi, lo = _canonical(hi0, lo0)
    changed = (bits(hi) != bits(hi0)) | (bits(lo) != bits(lo0))
    fast = _fast(x, hi0)
    maybe = _maybe_not_canonical(hi0, lo0)
    missed = changed & fast & ~maybe
    assert not bool(missed.any()), f"{int(missed.sum())} pairs, first x = {x[missed][0]!r}"
    # the normalisation is needed: ties beside odd weights (e.g. 1 + 2**-7 + 2**-8 - 2**-23
    # lands as (1 + 2**-7, 2**-8) and becomes (1 + 2**-6, -2**-8)), and -0; 64 low halves
    # per normal high half and sign round to such a tie (docs/strategies.md derives it)
    assert int((changed & fast).sum()) > 500
    assert bool((changed & fast & (bits(hi0) == -0x8000)).any())
    x_tie = torch.tensor([1.0 + 2.0**-7 + 2.0**-8 - 2.0**-23])
    h, l = _landing(x_tie)
    assert (h.item(), l.item()) == (1.0 + 2.0**-7, 2.0**-8)
    assert tuple(t.item() for t in _canonical(h, l)) == (1.0 + 2.0**-6, -(2.0**-8))
    # and the proof's condition is needed: where a rounding is subnormal the normalisation
    # changes pairs the cheap test passes (a tie at a subnormal half gap, lo = -0); the
    # kernels redo those blocks exactly, normalising every pair
    assert bool((changed & ~fast & ~maybe).any())


@pytest.mark.parametrize("pairs", [True, False], ids=["32-wide", "16-wide"])
def test_kernel_pairs_are_the_exact_canonical_pairs(pairs: bool, kernel_lib) -> None:
    x = _inputs()
    want_hi, want_lo = _canonical(*_landing(x))
    got_hi = torch.empty(x.numel(), dtype=BF16)
    got_lo = torch.empty(x.numel(), dtype=BF16)
    kernel_lib.collage_residual_pairs(x.data_ptr(), x.numel(), got_hi.data_ptr(), got_lo.data_ptr(),
                               int(pairs))
    for got, want, what in ((got_hi, want_hi, "hi"), (got_lo, want_lo, "lo")):
        diff = bits(got) != bits(want)
        assert not bool(diff.any()), (f"{what}: {int(diff.sum())} differ, first at x = "
                                      f"{x[diff][0].item()!r}")


def test_kahan_keeps_its_normalisation() -> None:
    """Kahan's pair is not the residual landing's: its low part is what the rounded add
    lost, which can lie below float32's last place of the weight. From the weight 1 with the
    compensation 2**-20 + 2**-27 at lr = 0 the landing makes that same pair again, and
    the normalisation, whose float32 sum drops 2**-27, stores (1, 2**-20): it is not the
    identity on Kahan's pairs, so every path keeps it (and the bits with it)."""
    for options in ({}, {"foreach": True}, {"foreach": False}):
        param = torch.nn.Parameter(torch.ones(40, dtype=BF16))
        opt = collage.AdamW([param], lr=0.0, weight_decay=0.0, strategy="kahan", **options)
        param.grad = torch.zeros_like(param)
        opt.step()
        with torch.no_grad():
            opt.state[param]["compensation"].fill_(2.0**-20 + 2.0**-27)
        param.grad = torch.full_like(param, 0.5)
        opt.step()
        assert param.detach().tolist() == [1.0] * 40
        assert opt.state[param]["compensation"].tolist() == [2.0**-20] * 40, options
