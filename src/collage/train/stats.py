"""Statistics over seeds: Student's t distribution, t intervals and the paired t test.

Written from the mathematics (scipy is not a dependency):

* the regularized incomplete beta function ``I_x(a, b)`` by its continued fraction
  (evaluated with the modified Lentz method, the idea of Numerical Recipes' ``betacf``);
* Student's t distribution through it: for ``T ~ t(df)``,
  ``P(|T| > t) = I_{df / (df + t^2)}(df / 2, 1 / 2)``;
* its quantile by bisection on that monotone function;
* the t interval of a mean and the paired t test of two equally seeded series.

The tests check the quantiles against published table values to nine digits
(``tests/train/test_stats.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CONFIDENCE", "Estimate", "PairedTest", "betainc", "estimate", "paired_t_test",
           "t_cdf", "t_critical", "t_quantile", "t_two_sided_p"]

#: The confidence of every interval and the level of every test (two-sided 5 %).
CONFIDENCE = 0.95
_LENTZ_TINY = 1e-300  # keeps Lentz's ratios away from division by zero
_LENTZ_EPS = 1e-15    # a continued-fraction factor this close to 1 ends the evaluation
_LENTZ_MAX_TERMS = 10_000


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of ``I_x(a, b)``: ``I_x(a, b) = front * cf / a`` with
    ``front = x^a (1-x)^b / B(a, b)``; it converges fast for ``x < (a + 1) / (a + b + 2)``.

    The fraction is ``1 / (1 + d1 / (1 + d2 / (1 + ...)))`` with
    ``d_{2m+1} = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1))`` and
    ``d_{2m} = m (b-m) x / ((a+2m-1)(a+2m))``; modified Lentz keeps the ratios ``c`` and
    ``1/d`` of successive numerators and denominators instead of the growing terms.
    """
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _LENTZ_TINY else _LENTZ_TINY)
    result = d
    for m in range(1, _LENTZ_MAX_TERMS):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _LENTZ_TINY else _LENTZ_TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _LENTZ_TINY else _LENTZ_TINY
            factor = d * c
            result *= factor
        if abs(factor - 1.0) < _LENTZ_EPS:
            return result
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0``, ``0 <= x <= 1``.

    The continued fraction converges quickly only below ``(a + 1) / (a + b + 2)``; above,
    the symmetry ``I_x(a, b) = 1 - I_{1-x}(b, a)`` moves the argument there.
    """
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc needs a, b > 0 and 0 <= x <= 1, got {a}, {b}, {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's ``T`` with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """``P(T <= t)``: the distribution is symmetric, so each side is half the two-sided
    tail."""
    tail = 0.5 * t_two_sided_p(t, df)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``t`` with ``P(T <= t) = p`` (``0 < p < 1``), by bisection: ``t_cdf`` is
    increasing, so halving a bracket ``[low, high]`` that holds the answer converges to it;
    it stops when the bracket is as narrow as float64 allows."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:  # grow the bracket until it holds the quantile
        low, high = high, 2.0 * high
    while high - low > 4 * math.ulp(high):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return 0.5 * (low + high)


@functools.lru_cache(maxsize=None)
def t_critical(df: int) -> float:
    """The two-sided ``CONFIDENCE`` critical value ``t_{(1+CONFIDENCE)/2, df}`` (cached: a
    band over thousands of points needs it once)."""
    return t_quantile(0.5 + CONFIDENCE / 2, df)


@dataclass(frozen=True)
class Estimate:
    """The mean of ``n`` values with its sample standard deviation and the half-width of
    its two-sided ``CONFIDENCE`` Student t interval (``mean ± ci``). With one value, or
    a non-finite one (a diverged run), there is no spread to estimate: ``std`` and ``ci``
    are None."""

    n: int
    mean: float
    std: float | None
    ci: float | None

    def text(self, spec: str = ".4f") -> str:
        """``mean ± ci`` (or the mean alone, with one value)."""
        if self.ci is None:
            return format(self.mean, spec)
        return f"{format(self.mean, spec)} ± {format(self.ci, spec)}"


def _sample_std(values: Sequence[float], mean: float) -> float:
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def estimate(values: Sequence[float]) -> Estimate:
    """Mean, sample standard deviation (``n - 1`` in the denominator) and the half-width
    ``t_{(1+CONFIDENCE)/2, n-1} * std / sqrt(n)`` of the t interval of the mean."""
    n = len(values)
    if n == 0:
        raise ValueError("an estimate needs at least one value")
    mean = math.fsum(values) / n
    if n == 1 or not all(math.isfinite(v) for v in values):  # no spread to estimate
        return Estimate(n=n, mean=mean, std=None, ci=None)
    std = _sample_std(values, mean)
    ci = t_critical(n - 1) * std / math.sqrt(n)
    return Estimate(n=n, mean=mean, std=std, ci=ci)


@dataclass(frozen=True)
class PairedTest:
    """The paired t test of ``a - b`` over ``n`` shared seeds (two-sided, level
    ``1 - CONFIDENCE``). ``difference`` is the mean of ``a - b`` with its t interval.

    ``p`` is None with fewer than two pairs or a non-finite value (nothing to test). When
    every difference is the same, the sample variance is 0 and ``t`` is undefined (0 / 0)
    or infinite: a zero difference everywhere gives ``p = 1`` (no evidence of a difference),
    a constant non-zero one ``p = 0`` (t infinite)."""

    n: int
    difference: Estimate
    t: float | None
    p: float | None

    @property
    def significant(self) -> bool | None:
        """Whether the difference is significant at the test's level (None: untestable)."""
        return None if self.p is None else self.p < 1.0 - CONFIDENCE

    def to_dict(self) -> dict[str, float | int | bool | None]:
        d = self.difference
        return {"n": self.n, "mean_difference": d.mean, "std_difference": d.std,
                "ci95_difference": d.ci, "t": self.t, "p": self.p,
                "significant": self.significant}


def paired_t_test(a: Sequence[float], b: Sequence[float]) -> PairedTest:
    """Test whether ``a`` and ``b`` (the same seeds, in the same order) differ on average:
    ``t = mean(a - b) / (std(a - b) / sqrt(n))`` with ``n - 1`` degrees of freedom."""
    if len(a) != len(b):
        raise ValueError(f"a paired test needs equally long series, got {len(a)} and {len(b)}")
    differences = [x - y for x, y in zip(a, b)]
    difference = estimate(differences)
    n = len(differences)
    if difference.std is None:  # one pair, or a non-finite value: nothing to test
        return PairedTest(n=n, difference=difference, t=None, p=None)
    if difference.std == 0.0:
        if difference.mean == 0.0:
            return PairedTest(n=n, difference=difference, t=None, p=1.0)
        infinite = math.copysign(math.inf, difference.mean)
        return PairedTest(n=n, difference=difference, t=infinite, p=0.0)
    t = difference.mean / (difference.std / math.sqrt(n))
    return PairedTest(n=n, difference=difference, t=t, p=t_two_sided_p(t, n - 1))
