"""Wilson and bootstrap intervals (kvlib.eval.intervals) against published and hand-computed values.

scipy is not installed here: the Wilson references are Newcombe (1998), "Two-sided confidence
intervals for the single proportion: comparison of seven methods", Statistics in Medicine 17,
Table I, method 3 (score interval without continuity correction), to 4 decimals.
"""

import numpy as np
import pytest

from kvlib.eval.intervals import bootstrap_interval, stratified_bootstrap_interval, wilson_interval, z_value


@pytest.mark.parametrize(
    "k, n, low, high",
    [
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
        (29, 29, 0.8830, 1.0),
        # by the formula with z = 1.959964: centre (5 + 1.9208) / 13.8415, half 1.959964 / 13.8415 * sqrt(2.5 + 0.9604)
        (5, 10, 0.2366, 0.7634),
    ],
)
def test_wilson_matches_newcombe(k, n, low, high):
    got = wilson_interval(k, n)
    assert round(got[0], 4) == low and round(got[1], 4) == high


def test_z_value():
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)


@pytest.mark.parametrize(
    "k, n, message",
    [
        (0, 0, "trials >= 1"),
        (3, 2, "0 <= successes <= trials"),
        (-1, 2, "0 <= successes"),
        (1.5, 2, "whole number"),
        (True, 2, "whole number"),
    ],
)
def test_wilson_bad_input(k, n, message):
    with pytest.raises(ValueError, match=message):
        wilson_interval(k, n)


def test_bootstrap_is_seeded_and_near_the_normal_interval():
    values = np.random.default_rng(1).normal(0.5, 1.0, 400)
    low, high = bootstrap_interval(values)
    assert (low, high) == bootstrap_interval(values)  # seeded: the same every time
    half = 1.959964 * values.std(ddof=1) / 20  # mean +- z s / sqrt(n)
    assert low == pytest.approx(values.mean() - half, abs=0.01) and high == pytest.approx(values.mean() + half, abs=0.01)
    assert bootstrap_interval([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3))


def test_bootstrap_of_two_values_spans_them():
    # the mean of a resample of [0, 1] is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4: the 2.5% and 97.5% points are 0 and 1
    assert bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)


def test_stratified_bootstrap_averages_strata_means():
    low, high = stratified_bootstrap_interval([[1.0, 1.0, 1.0], [0.0, 0.0]])
    assert low == high == 0.5


@pytest.mark.parametrize(
    "values, message",
    [([], "at least 2 values"), ([0.5], "at least 2 values"), ([0.1, float("nan")], "finite values")],
)
def test_bootstrap_bad_input(values, message):
    with pytest.raises(ValueError, match=message):
        bootstrap_interval(values)
    with pytest.raises(ValueError, match="confidence must be in"):
        bootstrap_interval([0.1, 0.2], confidence=1.5)
