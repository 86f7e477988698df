"""Exact McNemar and paired bootstrap tests (kvlib.eval.paired_tests) against hand-computed values.

McNemar's exact p is the two-sided binomial test of the discordant pairs at 1/2 (scipy's
``binomtest(min, b + c).pvalue`` for this symmetric case): with b = 0, c = 5, 2 / 2**5 = 0.0625;
with b = 2, c = 8, 2 (1 + 10 + 45) / 2**10 = 0.109375.
"""

import numpy as np
import pytest

from kvlib.eval.paired_tests import mcnemar_exact_p, mcnemar_test, paired_bootstrap_p, stratified_paired_bootstrap_p


@pytest.mark.parametrize(
    "only_a, only_b, p",
    [(0, 5, 0.0625), (5, 0, 0.0625), (2, 8, 0.109375), (3, 3, 1.0), (0, 0, 1.0), (0, 1, 1.0), (0, 10, 2 / 1024), (1, 20, 2 * 22 / 2**21)],
)
def test_mcnemar_exact(only_a, only_b, p):
    assert mcnemar_exact_p(only_a, only_b) == pytest.approx(p, rel=1e-12)


def test_mcnemar_of_score_lists_counts_only_discordant_pairs():
    a = [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    b = [1, 0, 0, 0, 0, 0, 0, 1, 1, 1]  # a alone passes 4 cases, b alone none
    assert mcnemar_test(a, b) == pytest.approx(2 / 16)
    assert mcnemar_exact_p(2000, 2100) < 0.2  # large counts stay exact and finite


@pytest.mark.parametrize(
    "a, b, message",
    [([1, 0], [1], "same cases"), ([], [], "at least one case"), ([1, 0.5], [1, 1], "pass/fail"), ([1], [2], "pass/fail")],
)
def test_mcnemar_bad_input(a, b, message):
    with pytest.raises(ValueError, match=message):
        mcnemar_test(a, b)
    with pytest.raises(ValueError, match="whole number >= 0"):
        mcnemar_exact_p(-1, 2)


def test_paired_bootstrap():
    rng = np.random.default_rng(1)
    x = rng.normal(0.5, 1.0, 400)
    assert paired_bootstrap_p(x, x) == 1.0  # every difference 0
    assert paired_bootstrap_p(x, x - 0.2) == pytest.approx(1 / 2001)  # a constant shift: no replicate reaches it
    noise = x + rng.normal(0.0, 1.0, 400)
    p = paired_bootstrap_p(x, noise)
    assert 0.05 < p < 1 and p == paired_bootstrap_p(x, noise)  # no real difference; seeded
    # the null-centred bootstrap agrees with the paired t-test's normal approximation on large samples
    d = x - (x + rng.normal(0.1, 1.0, 400))
    t = abs(d.mean()) / (d.std(ddof=0) / 20)
    from statistics import NormalDist

    assert paired_bootstrap_p(x, x - d) == pytest.approx(2 * (1 - NormalDist().cdf(t)), abs=0.02)


def test_stratified_paired_bootstrap_and_bad_input():
    assert stratified_paired_bootstrap_p([[1.0, 0.0], [0.5, 0.5]], [[1.0, 0.0], [0.5, 0.5]]) == 1.0
    with pytest.raises(ValueError, match="same cases"):
        paired_bootstrap_p([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same tasks"):
        stratified_paired_bootstrap_p([[1.0]], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="at least one case"):
        paired_bootstrap_p([], [])
