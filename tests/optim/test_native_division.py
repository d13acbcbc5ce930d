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
import math

import numpy as np
import pytest
import torch

from collage.optim import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

#: the builds whose division differs: the default one and the vector source's two widths
#: (the AVX-512 build without AVX512-BF16 divides as the default AVX-512 one; the portable
#: one divides by the IEEE division), each 2**23 dividends a divisor
VECTOR_BUILDS = pytest.mark.parametrize("kernel_lib", ["default", "avx2", "vec128"],
                                        indirect=True)

#: every float32 in [1, 2): the significands (the exponents scale out of the quotient, which
#: neither overflows nor underflows for a square root over a divisor in (0, 1])
SIGNIFICANDS = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)


def _over(x: torch.Tensor, b: float, lib) -> torch.Tensor:
    """``x / b`` as the kernels of ``lib`` compute it (``collage_probe_over_bc2s``)."""
    out = torch.empty_like(x)
    status = lib.collage_probe_over_bc2s(x.data_ptr(), x.numel(), ctypes.c_float(b),
                                            out.data_ptr())
    if status == -1:
        pytest.skip("this build has no vector kernels (its division is the IEEE one)")
    return out


def _worst_reciprocals(count: int) -> list[float]:
    """The divisors in [1, 2) whose float32 reciprocal is farthest from 1 / b (in ulps of
    the reciprocal, float64 reference: 1 / b of a 24-bit b is exact to 2^-53)."""
    b = SIGNIFICANDS.numpy().astype(np.float64)
    rounded = (1.0 / SIGNIFICANDS).numpy().astype(np.float64)  # float32 division: IEEE
    exact = 1.0 / b
    ulp = np.ldexp(1.0, np.floor(np.log2(exact)).astype(np.int64) - 23)
    error = np.abs(rounded - exact) / ulp
    return [float(SIGNIFICANDS[i]) for i in np.argsort(-error)[:count]]


def _bias_corrections() -> list[float]:
    """``sqrt(1 - beta2**t)`` as the native path passes it (float64, rounded to float32),
    for common betas and steps, scaled into [1, 2) (a power of two is exact)."""
    out = []
    for beta2 in (0.999, 0.95, 0.98, 0.99, 0.9999):
        for step in (1, 2, 3, 10, 100, 1000, 5000):
            value = float(np.float32(math.sqrt(1.0 - beta2**step)))
            if value < 1.0:
                out.append(math.ldexp(value, -math.frexp(value)[1] + 1))
    return out


DIVISORS = sorted({*_worst_reciprocals(6), float(np.nextafter(np.float32(2), 0)),
                   float(np.nextafter(np.float32(1), 2)), 1.5, *_bias_corrections()[:10]})


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
    x = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 2.0**-74.5, 2.0**-63,
                      1.8446743e19, 1.0, 3.0, 1e-20] + [7.0] * 6, dtype=torch.float32)
    x[3] = torch.tensor(0x7FC12345, dtype=torch.int32).view(torch.float32)  # a payload
    got = _over(x, b, kernel_lib)
    want = x / torch.tensor(b, dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
