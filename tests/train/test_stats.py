"""Statistics over seeds: known answers for Student's t, the t interval and the paired test."""

from __future__ import annotations

import math

import pytest

from collage.train.stats import (
    Estimate,
    betainc,
    estimate,
    paired_t_test,
    t_cdf,
    t_critical,
    t_quantile,
    t_two_sided_p,
)

#: t_{0.975, df}: published two-sided 95 % critical values (e.g. NIST/SEMATECH e-Handbook,
#: table 1.3.6.7.2; scipy.stats.t.ppf agrees to all digits shown).
T975 = {1: 12.706204736, 2: 4.302652730, 4: 2.776445105, 9: 2.262157163, 29: 2.045229642}
#: Other published quantiles: (p, df) -> t_{p, df}.
OTHER = {(0.995, 1): 63.656741163, (0.95, 10): 1.812461123, (0.9995, 3): 12.923978636,
         (0.99, 20): 2.527977003, (0.9, 100): 1.290074761}


@pytest.mark.parametrize("df, expected", sorted(T975.items()))
def test_t_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-9)
    assert t_critical(df) == t_quantile(0.975, df)


@pytest.mark.parametrize("p_df, expected", sorted(OTHER.items()))
def test_other_quantiles(p_df, expected):
    p, df = p_df
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-8)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-8)  # symmetric


def test_t_cdf_closed_forms():
    """df = 1 is the Cauchy distribution, df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))."""
    for t in (-30.0, -2.5, -0.1, 0.0, 0.3, 1.0, 4.0, 100.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    assert t_two_sided_p(0.0, 7) == 1.0 and t_two_sided_p(math.inf, 7) == 0.0
    for p in (0.6, 0.9, 0.975, 0.999):
        assert t_cdf(t_quantile(p, 5), 5) == pytest.approx(p, abs=1e-13)


def test_incomplete_beta_known_values():
    """I_x(a, b) with integer a, b is a binomial tail: I_0.4(2, 3) = P(Bin(4, 0.4) >= 2) =
    6(.16)(.36) + 4(.064)(.6) + .0256 = 0.5248; I_x(1, 1) = x; I_x(a, 1) = x^a."""
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-14)
    assert betainc(3, 2, 0.6) == pytest.approx(1 - 0.5248, abs=1e-14)  # symmetry
    for x in (0.0, 0.01, 0.5, 0.93, 1.0):
        assert betainc(1, 1, x) == pytest.approx(x, abs=1e-15)
        assert betainc(2.5, 1, x) == pytest.approx(x ** 2.5, abs=1e-14)
    with pytest.raises(ValueError):
        betainc(0, 1, 0.5)


def test_t_interval_of_a_mean():
    """[1, 2, 3, 4]: mean 2.5, sample std sqrt(5/3) (squares 2.25 + 0.25 + 0.25 + 2.25 = 5
    over n - 1 = 3), half-width t_{0.975, 3} * std / 2 with t_{0.975, 3} = 3.182446305."""
    e = estimate([1.0, 2.0, 3.0, 4.0])
    assert e.n == 4 and e.mean == 2.5
    assert e.std == pytest.approx(math.sqrt(5 / 3), rel=1e-15)
    assert e.ci == pytest.approx(3.182446305 * math.sqrt(5 / 3) / 2, abs=1e-9)
    assert e.text(".2f") == "2.50 ± 2.05"


def test_one_value_has_no_interval():
    e = estimate([2.25])
    assert e == Estimate(n=1, mean=2.25, std=None, ci=None)
    assert e.text() == "2.2500"  # the mean alone: no interval to show
    with pytest.raises(ValueError):
        estimate([])
    diverged = estimate([2.0, math.nan])
    assert math.isnan(diverged.mean) and diverged.ci is None


def test_paired_t_test_by_hand():
    """a = [2.0, 2.5, 3.0, 3.5], b = [1.5, 2.25, 2.5, 3.25]: differences [0.5, 0.25, 0.5,
    0.25], mean 0.375, each 0.125 from it, so std = sqrt(4 * 0.015625 / 3) = 0.144338 and
    the standard error std / 2 = 0.0721688; t = 0.375 / 0.0721688 = 3 sqrt(3) = 5.196152
    with 3 degrees of freedom. Student's t with 3 degrees of freedom has
    F(t) = 1/2 + (1/pi) (u / (1 + u^2) + atan u), u = t / sqrt(3) = 3, so the two-sided
    p = 2 (1 - F) = 1 - (2/pi) (0.3 + atan 3) = 0.013846: significant at 5 %. The 95 %
    interval of the mean difference: 0.375 ± 3.182446305 * 0.0721688 = 0.375 ± 0.229673."""
    test = paired_t_test([2.0, 2.5, 3.0, 3.5], [1.5, 2.25, 2.5, 3.25])
    assert test.n == 4
    assert test.t == pytest.approx(3 * math.sqrt(3), rel=1e-12)
    expected_p = 1 - (2 / math.pi) * (0.3 + math.atan(3))
    assert expected_p == pytest.approx(0.013846, abs=1e-6)
    assert test.p == pytest.approx(expected_p, abs=1e-13)
    assert test.significant is True
    assert test.difference.mean == pytest.approx(0.375, rel=1e-15)
    assert test.difference.ci == pytest.approx(3.182446305 * math.sqrt(0.0625 / 3) / 2,
                                               abs=1e-9)
    reversed_test = paired_t_test([1.5, 2.25, 2.5, 3.25], [2.0, 2.5, 3.0, 3.5])
    assert reversed_test.t == pytest.approx(-test.t) and reversed_test.p == test.p


def test_paired_test_is_not_the_unpaired_one():
    """A constant offset under a large seed effect: the pairs show it, the spread of either
    series alone would hide it."""
    seed_effect = [0.0, 1.0, -1.0, 2.0, -2.0]
    a = [2.0 + s + 0.01 + 0.001 * i for i, s in enumerate(seed_effect)]
    b = [2.0 + s for s in seed_effect]
    assert paired_t_test(a, b).significant
    assert estimate(a).ci > 0.01  # the unpaired intervals overlap widely


def test_paired_test_edge_cases():
    same = paired_t_test([2.0, 2.1, 2.2], [2.0, 2.1, 2.2])
    assert same.p == 1.0 and same.t is None and same.significant is False
    assert same.difference.std == 0.0 and same.difference.ci == 0.0
    shifted = paired_t_test([2.5, 2.75, 3.0], [2.0, 2.25, 2.5])  # exactly 0.5 each
    assert shifted.p == 0.0 and shifted.t == math.inf and shifted.significant is True
    single = paired_t_test([2.0], [1.0])
    assert single.p is None and single.significant is None and single.difference.ci is None
    diverged = paired_t_test([2.0, math.nan], [1.0, 1.5])
    assert diverged.p is None
    with pytest.raises(ValueError, match="equally long"):
        paired_t_test([1.0, 2.0], [1.0])
    assert set(same.to_dict()) == {"n", "mean_difference", "std_difference",
                                   "ci95_difference", "t", "p", "significant"}
