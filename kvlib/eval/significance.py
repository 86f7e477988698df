"""What a report says about each score: its 95% interval, and paired tests against the full cache
and a named baseline on the same cases, significant at :data:`ALPHA`.

The baseline (``--baseline``) is ``NAME`` or ``NAME@BUDGET``: a policy that was run. ``NAME`` alone
compares each configuration with the baseline at the same budget (a baseline that takes no budget,
a codec alone, has one run, compared with every configuration); ``NAME@BUDGET`` compares every
configuration with that one run. A configuration is not compared with itself, and the full cache
is not compared with the baseline (the baseline's own row says how it compares with the full cache).

Two results are paired only when their cases are the same (:meth:`CaseScores.pairs_with`); a
result recorded without per-case scores has no interval and no test. A mean over tasks (the RULER
suite's) gets a bootstrap interval and a paired bootstrap test that resample each task's cases
apart (:func:`mean_interval`, :func:`paired_mean`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlib.errors import quoted
from kvlib.eval.case_scores import BOOTSTRAP_SEED
from kvlib.eval.compare_units import FULL, CompareRun, evicts
from kvlib.eval.intervals import RESAMPLES, stratified_bootstrap_interval
from kvlib.eval.paired_tests import stratified_paired_bootstrap_p
from kvlib.eval.task import TaskResult

ALPHA = 0.05
"""Significance level of every paired test in a report."""


@dataclass(frozen=True)
class Baseline:
    """The configuration(s) every other one is compared with: ``policy`` at ``budget`` (None: at
    each configuration's own budget, or the policy's single run when it takes no budget)."""

    policy: str
    budget: float | None = None

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}@{self.budget:g}"

    def reference(self, run: CompareRun, runs: Sequence[CompareRun]) -> CompareRun | None:
        """The baseline run ``run`` is compared with (None for the full cache, the baseline itself,
        or no baseline run at ``run``'s budget)."""
        if run.policy == FULL:
            return None
        candidates = [r for r in runs if r.policy == self.policy and not r.error]
        if self.budget is not None:
            wanted = self.budget
        elif any(r.budget is None for r in candidates):
            wanted = None
        else:
            wanted = run.budget
        found = next((r for r in candidates if r.budget == wanted), None)
        return None if found is None or found is run or (found.policy, found.budget) == (run.policy, run.budget) else found


def parse_baseline(text: str | None, policies: Sequence[str], budgets: Sequence[float]) -> Baseline | None:
    """The ``--baseline`` option, checked against the configurations that will run (before any
    model loads): ``ValueError`` naming the choices unless ``NAME`` is one of ``policies`` and a
    ``@BUDGET`` one of ``budgets`` for a policy that takes budgets."""
    if text is None:
        return None
    name, at, budget_text = text.strip().rpartition("@") if "@" in text else (text.strip(), "", "")
    if name not in policies:
        raise ValueError(f"--baseline {quoted(text)} is not one of the policies run; choose from {', '.join(policies)}")
    if not at:
        return Baseline(name)
    try:
        budget = float(budget_text)
    except ValueError:
        raise ValueError(f"--baseline {quoted(text)}: {quoted(budget_text)} is not a budget such as 0.25") from None
    if not evicts(name):
        raise ValueError(f"--baseline {quoted(text)}: {quoted(name)} keeps every token and runs once, with no budget; name it alone")
    if budget not in budgets:
        raise ValueError(f"--baseline {quoted(text)}: budget {budget:g} is not run; choose from {', '.join(f'{b:g}' for b in budgets)}")
    return Baseline(name, budget)


@dataclass(frozen=True)
class PairedResult:
    """A paired test of one configuration's score against a reference's on the same cases:
    ``difference`` = score - reference score; ``p`` two-sided."""

    against: str
    test: str
    difference: float
    p: float

    @property
    def significant(self) -> bool:
        return self.p < ALPHA

    def to_json(self) -> dict:
        return {"against": self.against, "test": self.test, "difference": self.difference, "p": self.p, "significant": self.significant}


def interval(result: TaskResult) -> tuple[float, float] | None:
    """``result``'s 95% interval, or None when it has no per-case scores (or one case under a bootstrap)."""
    return None if result.cases is None else result.cases.interval()


def paired(run: CompareRun, reference: CompareRun | None, task: str) -> PairedResult | None:
    """``run``'s score on ``task`` tested against ``reference``'s; None when either lacks the task or
    per-case scores, their cases differ, or ``reference`` is ``run``."""
    if reference is None or reference is run or task not in run.results or task not in reference.results:
        return None
    mine, theirs = run.results[task], reference.results[task]
    if mine.cases is None or theirs.cases is None or not mine.cases.pairs_with(theirs.cases):
        return None
    return PairedResult(reference.label, mine.cases.aggregate.test, mine.score - theirs.score, mine.cases.paired_p(theirs.cases))


def full_run(runs: Sequence[CompareRun]) -> CompareRun | None:
    """The full cache's run, if it finished."""
    return next((r for r in runs if r.policy == FULL and not r.error), None)


def same_cases(runs: Sequence[CompareRun], task: str) -> bool | None:
    """Whether every run that finished ``task`` scored the same cases (equal digests and counts);
    None when some result has no per-case scores (recorded before they were kept)."""
    results = [r.results[task] for r in runs if task in r.results]
    if not results or any(r.cases is None for r in results):
        return None
    return len({(r.cases.digest, r.cases.kind, len(r.cases.values)) for r in results}) == 1


def marks(run: CompareRun, runs: Sequence[CompareRun], task: str, baseline: Baseline | None) -> str:
    """The table's significance marks for ``run`` on ``task``: ``*`` when it differs from the full
    cache at p < :data:`ALPHA`, ``▲`` / ``▼`` when it is better / worse than the baseline."""
    text = ""
    against_full = paired(run, full_run(runs), task)
    if against_full is not None and against_full.significant:
        text += "*"
    if baseline is not None:
        against = paired(run, baseline.reference(run, runs), task)
        if against is not None and against.significant:
            better = (against.difference > 0) == run.results[task].higher_is_better
            text += "▲" if better else "▼"
    return text


def cases_note(runs: Sequence[CompareRun], tasks: Sequence[str]) -> str:
    """One line saying, per task, whether every configuration scored the same cases."""
    parts = []
    for task in tasks:
        same = same_cases(runs, task)
        counts = {len(r.results[task].cases.values) for r in runs if task in r.results and r.results[task].cases is not None}
        if same is None:
            parts.append(f"{task}: not checked (results recorded without per-case scores)")
        elif same:
            parts.append(f"{task}: the same {counts.pop()} cases for every configuration")
        else:
            parts.append(f"{task}: cases DIFFER between configurations, no paired test")
    return "Cases (checked by digest): " + "; ".join(parts) + "."


def legend(baseline: Baseline | None) -> str:
    """The table's note on intervals and marks."""
    against = (
        f"; ▲ / ▼: better / worse than the baseline {baseline.label}"
        + (" at the same budget" if baseline.budget is None else "")
        + f" (p < {ALPHA:g})"
        if baseline is not None
        else ""
    )
    return (
        "[low, high]: 95% interval (Wilson for pass/fail scores, bootstrap over cases otherwise, 2000 resamples);"
        f" *: differs from the full cache at p < {ALPHA:g} (paired on the same cases: exact McNemar for pass/fail"
        f" scores, paired bootstrap otherwise){against}."
    )


def _task_values(run: CompareRun, tasks: Sequence[str]) -> list[tuple[float, ...]] | None:
    """``run``'s per-case values on every task of ``tasks`` (None unless it has all of them as plain means or pass/fail)."""
    results = [run.results.get(task) for task in tasks]
    if any(r is None or r.cases is None or r.cases.kind == "exp_mean" for r in results):
        return None
    return [r.cases.values for r in results]


def mean_interval(run: CompareRun, tasks: Sequence[str]) -> tuple[float, float] | None:
    """95% interval of the mean of ``run``'s scores over ``tasks``: a bootstrap resampling each
    task's cases apart (None without per-case scores on every task, or with a task of one case)."""
    values = _task_values(run, tasks)
    if values is None or any(len(v) < 2 for v in values):
        return None
    return stratified_bootstrap_interval(values, resamples=RESAMPLES, seed=BOOTSTRAP_SEED)


def paired_mean(run: CompareRun, reference: CompareRun | None, tasks: Sequence[str]) -> PairedResult | None:
    """The mean over ``tasks`` of ``run`` tested against ``reference``'s by a paired bootstrap that
    resamples each task's cases apart (None unless both scored the same cases on every task)."""
    if reference is None or reference is run:
        return None
    mine, theirs = _task_values(run, tasks), _task_values(reference, tasks)
    if mine is None or theirs is None or not all(run.results[t].cases.pairs_with(reference.results[t].cases) for t in tasks):
        return None
    difference = sum(run.results[t].score - reference.results[t].score for t in tasks) / len(tasks)
    p = stratified_paired_bootstrap_p(mine, theirs, resamples=RESAMPLES, seed=BOOTSTRAP_SEED)
    return PairedResult(reference.label, "paired bootstrap (tasks apart)", difference, p)


def mean_marks(run: CompareRun, runs: Sequence[CompareRun], tasks: Sequence[str], baseline: Baseline | None) -> str:
    """:func:`marks` for the mean over ``tasks`` (higher is better)."""
    text = ""
    against_full = paired_mean(run, full_run(runs), tasks)
    if against_full is not None and against_full.significant:
        text += "*"
    against = None if baseline is None else paired_mean(run, baseline.reference(run, runs), tasks)
    if against is not None and against.significant:
        text += "▲" if against.difference > 0 else "▼"
    return text
