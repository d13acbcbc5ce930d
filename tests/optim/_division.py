"""The dividends and divisors of the tests of the division by the bias correction's root
without the divider (a rounded reciprocal and one fused multiply-add correction): the C
kernels' (``test_native_division.py``) and the Triton kernels'
(``test_triton_arithmetic.py``), the same operations, tried on the same cases."""

from __future__ import annotations

import math

import numpy as np
import torch

#: every float32 in [1, 2): the significands (the exponents scale out of the quotient, which
#: neither overflows nor underflows for a square root over a divisor in (0, 1])
SIGNIFICANDS = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)


def worst_reciprocals(count: int) -> list[float]:
    """The divisors in [1, 2) whose float32 reciprocal is farthest from 1 / b (in ulps of
    the reciprocal, float64 reference: 1 / b of a 24-bit b is exact to 2^-53)."""
    b = SIGNIFICANDS.numpy().astype(np.float64)
    rounded = (1.0 / SIGNIFICANDS).numpy().astype(np.float64)  # float32 division: IEEE
    exact = 1.0 / b
    ulp = np.ldexp(1.0, np.floor(np.log2(exact)).astype(np.int64) - 23)
    error = np.abs(rounded - exact) / ulp
    return [float(SIGNIFICANDS[i]) for i in np.argsort(-error)[:count]]


def bias_corrections() -> list[float]:
    """``sqrt(1 - beta2**t)`` as the native path passes it (float64, rounded to float32),
    for common betas and steps, scaled into [1, 2) (a power of two is exact)."""
    out = []
    for beta2 in (0.999, 0.95, 0.98, 0.99, 0.9999):
        for step in (1, 2, 3, 10, 100, 1000, 5000):
            value = float(np.float32(math.sqrt(1.0 - beta2**step)))
            if value < 1.0:
                out.append(math.ldexp(value, -math.frexp(value)[1] + 1))
    return out


DIVISORS = sorted({*worst_reciprocals(6), float(np.nextafter(np.float32(2), 0)),
                   float(np.nextafter(np.float32(1), 2)), 1.5, *bias_corrections()[:10]})


def special_dividends() -> torch.Tensor:
    """+0, -0, inf and NaN (with a payload), which the division passes through as they are;
    the smallest and largest square roots a float32 second moment has; a few ordinary
    values."""
    x = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 2.0**-74.5, 2.0**-63,
                      1.8446743e19, 1.0, 3.0, 1e-20] + [7.0] * 6, dtype=torch.float32)
    x[3] = torch.tensor(0x7FC12345, dtype=torch.int32).view(torch.float32)  # a payload
    return x
