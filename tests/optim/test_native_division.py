"""The vector kernels divide ``sqrt(v)`` by the bias correction's root without the divider
(``rounding.h``: ``v_over_bc2s``; ``step_vector.h``: ``g_over_bc2s``, the same on every
vector width; a reciprocal and one fused-multiply-add correction), each backend this CPU
runs (conftest.kernel_lib): the
IEEE quotient, bit for bit, for every significand of the dividend, for the divisors where a
correction by a rounded reciprocal is most at risk (the reciprocals whose rounding error is
closest to half an ulp, the all-ones and 1 + ulp significands) and the bias corrections of
real runs; and for the dividends the step passes through (+0, -0, inf, NaN)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from collage.optim import native

from ._division import DIVISORS, SIGNIFICANDS, special_dividends

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

#: the builds whose division differs: the default one and the vector source's two widths
#: (the AVX-512 build without AVX512-BF16 divides as the default AVX-512 one; the portable
#: one divides by the IEEE division), each 2**23 dividends a divisor
VECTOR_BUILDS = pytest.mark.parametrize("kernel_lib", ["default", "avx2", "vec128"],
                                        indirect=True)


def _over(x: torch.Tensor, b: float, lib) -> torch.Tensor:
    """``x / b`` as the kernels of ``lib`` compute it (``collage_probe_over_bc2s``)."""
    out = torch.empty_like(x)
    status = lib.collage_probe_over_bc2s(x.data_ptr(), x.numel(), ctypes.c_float(b),
                                            out.data_ptr())
    if status == -1:
        pytest.skip("this build has no vector kernels (its division is the IEEE one)")
    return out


@pytest.mark.parametrize("b", DIVISORS, ids=lambda b: f"{np.float32(b).view(np.uint32):#x}")
@VECTOR_BUILDS
def test_every_significand_is_the_ieee_quotient(b: float, kernel_lib) -> None:
    got = _over(SIGNIFICANDS, b, kernel_lib)
    want = SIGNIFICANDS / torch.tensor(b, dtype=torch.float32)  # IEEE, correctly rounded
    differ = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert differ.numel() == 0, [(float(SIGNIFICANDS[i]), b) for i in differ[:5].flatten()]


@pytest.mark.parametrize("b", [1.0, 0.03162277, 0.5, 0.7071068, 0.9995])
@VECTOR_BUILDS
def test_the_values_passed_through_and_the_extremes(b: float, kernel_lib) -> None:
    """+0, -0, inf and NaN (with its payload) come back as the division gives them; the
    smallest and largest square roots a float32 second moment has are divided exactly."""
    x = special_dividends()
    got = _over(x, b, kernel_lib)
    want = x / torch.tensor(b, dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
