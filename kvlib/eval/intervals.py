"""Confidence intervals for a score over cases: Wilson's for an accuracy, a percentile bootstrap
over cases for any other mean.

Both are two-sided at ``confidence`` (default 0.95). The bootstrap is seeded: the same values, seed
and resample count give the same interval on every machine (numpy's ``default_rng``). A stratified
bootstrap resamples each stratum (a task's cases) apart and averages the strata's means, so a mean
over tasks gets an interval that keeps each task's case count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

RESAMPLES = 2000
"""Bootstrap resamples drawn by default."""


def z_value(confidence: float) -> float:
    """The standard normal quantile of a two-sided ``confidence`` (1.959964 at 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for an accuracy of ``successes`` out of ``trials`` (Wilson 1927;
    Newcombe 1998, method 3): ``(centre - half, centre + half)`` with ``centre = (k + z²/2) / (n + z²)``
    and ``half = z / (n + z²) * sqrt(k (n - k) / n + z²/4)``; within [0, 1] and never empty.

    ``ValueError`` unless ``0 <= successes <= trials`` and ``trials >= 1`` (whole numbers)."""
    for name, value in (("successes", successes), ("trials", trials)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"wilson_interval: {name} must be a whole number, got {value!r}")
    if trials < 1:
        raise ValueError(f"wilson_interval needs trials >= 1, got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval needs 0 <= successes <= trials, got {successes} of {trials}")
    z = z_value(confidence)
    centre = (successes + z * z / 2) / (trials + z * z)
    half = z / (trials + z * z) * math.sqrt(successes * (trials - successes) / trials + z * z / 4)
    return max(0.0, centre - half), min(1.0, centre + half)


def as_strata(strata: Sequence[Sequence[float]], what: str, least: int) -> list[np.ndarray]:
    """The strata as float arrays; ``ValueError`` for none, one with fewer than ``least`` values, or a non-finite value."""
    if not strata:
        raise ValueError(f"{what} needs at least one group of values")
    arrays = [np.asarray(values, dtype=float) for values in strata]
    for array in arrays:
        if array.ndim != 1 or array.size < least:
            raise ValueError(f"{what} needs at least {least} values per group, got {array.size}")
        if not np.isfinite(array).all():
            raise ValueError(f"{what} needs finite values")
    return arrays


def check_resamples(resamples: int) -> None:
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")


def stratified_bootstrap_means(strata: Sequence[Sequence[float]], resamples: int, seed: int) -> np.ndarray:
    """``resamples`` bootstrap replicates of the mean of the strata's means: each stratum is
    resampled with replacement to its own size, independently (float64 ``[resamples]``)."""
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for array in strata:
        picks = rng.integers(0, array.size, size=(resamples, array.size))
        total += array[picks].mean(axis=1)
    return total / len(strata)


def stratified_bootstrap_interval(
    strata: Sequence[Sequence[float]], *, confidence: float = 0.95, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the strata's means (each stratum, a task's
    cases, resampled apart); ``ValueError`` for an empty stratum, one of a single case (its
    bootstrap would have no spread) or a non-finite value."""
    arrays = as_strata(strata, "a bootstrap interval", 2)
    check_resamples(resamples)
    tail = (1.0 - confidence) / 2 * 100
    z_value(confidence)  # validates confidence
    low, high = np.percentile(stratified_bootstrap_means(arrays, resamples, seed), [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_interval(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (at least 2 cases): the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of ``resamples`` means of
    resamples with replacement (Efron and Tibshirani 1993, ch. 13)."""
    return stratified_bootstrap_interval([values], confidence=confidence, resamples=resamples, seed=seed)
