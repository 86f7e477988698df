"""Paired tests between two configurations scored on the same cases: exact McNemar for pass/fail
scores, a paired bootstrap for any other score. Both return a two-sided p-value.

Pairing is by position: ``a[i]`` and ``b[i]`` are the same case. Unequal lengths are a
``ValueError``, as is an empty input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvlib.eval.intervals import RESAMPLES, as_strata, check_resamples, stratified_bootstrap_means


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Exact McNemar p-value from the discordant counts (cases only ``a`` passed, cases only ``b``
    passed): two-sided binomial test of ``min(only_a, only_b)`` out of ``only_a + only_b`` at 1/2,
    ``min(1, 2 * P(X <= min))``; 1.0 with no discordant case. Computed exactly in integers."""
    for name, value in (("only_a", only_a), ("only_b", only_b)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"mcnemar_exact_p: {name} must be a whole number >= 0, got {value!r}")
    n, low = int(only_a) + int(only_b), min(int(only_a), int(only_b))
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(low + 1))
    return min(1.0, 2 * tail / 2**n)


def _pass_fail(values: Sequence[float], name: str) -> list[bool]:
    flags = []
    for value in values:
        if value not in (0, 1):
            raise ValueError(f"mcnemar_test: {name} must hold pass/fail scores (0 or 1), got {value!r}")
        flags.append(bool(value))
    return flags


def _check_pair(a: Sequence, b: Sequence, what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what} needs the same cases on both sides, got {len(a)} and {len(b)} values")
    if len(a) == 0:
        raise ValueError(f"{what} needs at least one case")


def mcnemar_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Exact McNemar p-value of two pass/fail score lists (1 pass, 0 fail) on the same cases."""
    _check_pair(a, b, "mcnemar_test")
    passed_a, passed_b = _pass_fail(a, "a"), _pass_fail(b, "b")
    only_a = sum(x and not y for x, y in zip(passed_a, passed_b))
    only_b = sum(y and not x for x, y in zip(passed_a, passed_b))
    return mcnemar_exact_p(only_a, only_b)


def stratified_paired_bootstrap_p(
    a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], *, resamples: int = RESAMPLES, seed: int = 0
) -> float:
    """Two-sided paired bootstrap p-value for the mean over strata of the per-stratum mean
    difference ``a - b`` (strata: tasks; each resampled apart). The differences are centred to
    mean zero in each stratum (the null hypothesis) and resampled; the p-value is
    ``(1 + #{|replicate| >= |observed|}) / (1 + resamples)`` (Efron and Tibshirani 1993, sec. 16.4;
    Davison and Hinkley 1997, eq. 4.11), so it is never 0, and it is 1 when every difference is 0."""
    if len(a) != len(b):
        raise ValueError(f"a paired bootstrap needs the same tasks on both sides, got {len(a)} and {len(b)}")
    for x, y in zip(a, b):
        _check_pair(x, y, "a paired bootstrap")
    check_resamples(resamples)
    differences = [x - y for x, y in zip(as_strata(a, "a paired bootstrap", 1), as_strata(b, "a paired bootstrap", 1))]
    observed = float(np.mean([d.mean() for d in differences]))
    centred = [d - d.mean() for d in differences]
    replicates = stratified_bootstrap_means(centred, resamples, seed)
    tolerance = 1e-12 * max(1.0, abs(observed))  # a replicate equal to the observation up to rounding counts
    extreme = int(np.count_nonzero(np.abs(replicates) >= abs(observed) - tolerance))
    return (1 + extreme) / (1 + resamples)


def paired_bootstrap_p(a: Sequence[float], b: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0) -> float:
    """Two-sided paired bootstrap p-value for the mean difference of ``a`` and ``b`` on the same cases."""
    return stratified_paired_bootstrap_p([a], [b], resamples=resamples, seed=seed)
