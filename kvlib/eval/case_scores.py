"""A task result's per-case scores, and what they support: an interval for the score and a paired
test against another configuration's scores on the same cases.

How a task's score comes from its cases is its :class:`Aggregate`, named by ``kind``:

- ``"pass_fail"``: each case passed (1) or failed (0); the score is the accuracy; Wilson interval;
  exact McNemar test;
- ``"mean"``: any per-case score; the score is their mean; bootstrap interval over cases; paired
  bootstrap test;
- ``"exp_mean"``: per-case values on a log scale (a window's mean negative log-likelihood, nats);
  the score is ``exp`` of their mean (perplexity); the bootstrap interval of the mean, exponentiated
  (percentiles commute with a monotone map); paired bootstrap test on the log values.

``digest`` names the cases themselves (their prompts and answers, not what a configuration
wrote), so two results are paired only when their digests are equal: the same cases in the same
order, as seeded tasks give every configuration.
"""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvlib.eval.intervals import RESAMPLES, bootstrap_interval, wilson_interval
from kvlib.eval.paired_tests import mcnemar_test, paired_bootstrap_p

BOOTSTRAP_SEED = 0
"""Seed of every bootstrap a report draws: a report's intervals and p-values are reproducible."""


def cases_digest(cases: Iterable[object]) -> str:
    """16 hex digits of SHA-256 over the ``repr`` of each case (tuples of ids, strings, numbers:
    reprs that are the same on every machine), in order."""
    digest = hashlib.sha256()
    for case in cases:
        digest.update(repr(case).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


class Aggregate(abc.ABC):
    """How a score, its interval and a paired test come from per-case values (one subclass per kind)."""

    kind = ""
    interval_method = ""
    test = ""

    def score(self, values: Sequence[float]) -> float:
        return float(np.mean(values))

    @abc.abstractmethod
    def interval(self, values: Sequence[float]) -> tuple[float, float] | None:
        """The 95% interval of the score, or None when the cases cannot give one."""

    def paired_p(self, values: Sequence[float], other: Sequence[float]) -> float:
        """Two-sided p-value that the two configurations' scores on these cases are equal."""
        return paired_bootstrap_p(values, other, resamples=RESAMPLES, seed=BOOTSTRAP_SEED)


class PassFail(Aggregate):
    kind, interval_method, test = "pass_fail", "Wilson", "exact McNemar"

    def interval(self, values: Sequence[float]) -> tuple[float, float]:
        return wilson_interval(int(sum(values)), len(values))

    def paired_p(self, values: Sequence[float], other: Sequence[float]) -> float:
        return mcnemar_test(values, other)


class Mean(Aggregate):
    kind, interval_method, test = "mean", "bootstrap", "paired bootstrap"

    def interval(self, values: Sequence[float]) -> tuple[float, float] | None:
        if len(values) < 2:
            return None
        return bootstrap_interval(values, resamples=RESAMPLES, seed=BOOTSTRAP_SEED)


class ExpMean(Mean):
    kind = "exp_mean"

    def score(self, values: Sequence[float]) -> float:
        return math.exp(float(np.mean(values)))

    def interval(self, values: Sequence[float]) -> tuple[float, float] | None:
        log_interval = super().interval(values)
        return None if log_interval is None else (math.exp(log_interval[0]), math.exp(log_interval[1]))


AGGREGATES: dict[str, Aggregate] = {a.kind: a for a in (PassFail(), Mean(), ExpMean())}
"""Every aggregate by its kind."""


@dataclass(frozen=True)
class CaseScores:
    """One configuration's per-case values on one task, in case order; ``kind`` names the
    :class:`Aggregate` (a key of :data:`AGGREGATES`), ``digest`` the cases (:func:`cases_digest`)."""

    values: tuple[float, ...]
    kind: str
    digest: str

    def __post_init__(self) -> None:
        if self.kind not in AGGREGATES:
            raise ValueError(f"unknown case score kind {self.kind!r}; choose from {', '.join(AGGREGATES)}")
        if not self.values:
            raise ValueError("case scores need at least one case")
        if self.kind == "pass_fail" and any(v not in (0, 1) for v in self.values):
            raise ValueError("pass_fail case scores must be 0 or 1")

    @property
    def aggregate(self) -> Aggregate:
        return AGGREGATES[self.kind]

    def interval(self) -> tuple[float, float] | None:
        """The score's 95% interval (None for a bootstrap over a single case)."""
        return self.aggregate.interval(self.values)

    def pairs_with(self, other: CaseScores) -> bool:
        """Whether ``other`` scored the same cases the same way, so that a paired test applies."""
        return self.digest == other.digest and self.kind == other.kind and len(self.values) == len(other.values)

    def paired_p(self, other: CaseScores) -> float:
        """Two-sided p-value of the aggregate's paired test; ``ValueError`` unless :meth:`pairs_with`."""
        if not self.pairs_with(other):
            raise ValueError("a paired test needs the same cases (equal digests, kinds and counts)")
        return self.aggregate.paired_p(self.values, other.values)

    def to_json(self) -> dict:
        return {"kind": self.kind, "digest": self.digest, "values": list(self.values)}

    @classmethod
    def from_json(cls, record: dict) -> CaseScores:
        return cls(tuple(float(v) for v in record["values"]), record["kind"], record["digest"])


def case_scores(values: Sequence[float], kind: str, cases: Iterable[object]) -> CaseScores:
    """:class:`CaseScores` of ``values`` with the digest of ``cases`` (what identifies each case)."""
    return CaseScores(tuple(float(v) for v in values), kind, cases_digest(cases))
