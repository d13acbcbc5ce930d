"""Per-block power-of-two scales (collage.mcf.blocks): exact against a float64 definition."""

from __future__ import annotations

import pytest
import torch

from collage import mcf
from collage.mcf.blocks import block_scales, block_scales_reference, expand_scales

BLOCK = 16


def _adversarial() -> torch.Tensor:
    """Magnitudes across float32's range, exact powers of two (binade edges), their
    neighbours, zeros, float32 subnormals, and non-finite values, in blocks of 16."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(8 * BLOCK, generator=g) * torch.exp2(torch.randint(-120, 120, (8 * BLOCK,),
                                                                          generator=g).float())
    edges = torch.exp2(torch.arange(-20, 20, dtype=torch.float32))
    below = torch.nextafter(edges, torch.zeros_like(edges))
    special = torch.tensor([0.0, -0.0, 1e-45, -3e-42, 2**-126, float("inf"), float("nan"),
                            -float("inf"), 3e38, -3.4e38, 1.0, -1.0, 7.0, 0.0, 0.0, 5e-39])
    zeros = torch.zeros(BLOCK)
    nonfinite = torch.tensor([float("nan")] * BLOCK)
    tail = torch.tensor([0.75, -3.0, 1e-3])  # a last, partial block
    return torch.cat([wide, edges, below, special, zeros, nonfinite, tail])


def test_fast_scales_equal_the_float64_definition():
    x = _adversarial()
    for top in (7, 14):
        fast = block_scales(x, BLOCK, top)
        assert fast.dtype == torch.float32
        assert torch.equal(fast.double(), block_scales_reference(x, BLOCK, top))


@pytest.mark.parametrize("top", [7, 14])
def test_block_maximum_lands_in_the_target_binade(top):
    x = _adversarial()
    scales = block_scales(x, BLOCK, top).double()
    mag = x.double().abs()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
    blocks = scales.numel()
    padded = torch.cat([mag, mag.new_zeros(blocks * BLOCK - mag.numel())]).view(blocks, BLOCK)
    scaled_max = padded.amax(1) / scales
    normal = (padded.amax(1) >= 2.0**-126 * 2**top) & (padded.amax(1) <= 2.0**(127 + top))
    assert ((scaled_max[normal] >= 2.0**top) & (scaled_max[normal] < 2.0 ** (top + 1))).all()
    assert (scales[padded.amax(1) == 0] == 1).all()  # all-zero and all-nan blocks: 1
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two


def test_scaling_is_exact_and_keeps_mcf_identities():
    """x / s * s == x bit for bit, and a bf16 split of x / s is the scaled split of x."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40 * BLOCK, generator=g) * 1e-6).double()
    s = expand_scales(block_scales(x.float(), BLOCK, 7), x.numel(), BLOCK).double()
    assert torch.equal(x / s * s, x)
    hi, lo = mcf.split(x, torch.bfloat16, 2)
    hi_s, lo_s = mcf.split(x / s, torch.bfloat16, 2)
    assert torch.equal(hi_s.double() * s, hi.double())
    assert torch.equal(lo_s.double() * s, lo.double())


def test_expand_scales_covers_a_partial_last_block():
    scales = torch.tensor([1.0, 2.0, 4.0])
    out = expand_scales(scales, 2 * BLOCK + 3, BLOCK)
    assert out.tolist() == [1.0] * BLOCK + [2.0] * BLOCK + [4.0] * 3
