"""The per-case scorers of kvpress's evaluation (``evaluation/benchmarks/*/calculate_metrics.py``)
that are simple and deterministic, chosen by a row's ``task``.

- RULER (``niah_*``, ``vt``, ``cwe``, ``fwe``: ``string_match_all``; ``qa_*``: ``string_match_part``),
  on the prediction with control characters removed and ends stripped (kvpress's clean-up);
- LongBench's QA F1 (``narrativeqa``, ``qasper``, ``multifieldqa_en``, ``hotpotqa``, ``2wikimqa``,
  ``musique``, ``triviaqa``), ``passage_retrieval_en`` and ``passage_count``: the best score over the
  answers, on the prediction stripped at the left (``triviaqa``: its first line);
- no ``task``: :data:`DEFAULT_SCORER` (RULER's ``string_match_all``).

kvpress tasks scored by ROUGE, code similarity, a class list, Chinese segmentation or a model are
not implemented: a file naming one is refused before the model loads (:func:`scorer_for`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvlib.eval.scoring import string_match_all, string_match_part, token_f1

_CONTROL = re.compile(r"[\x00-\x1f]")
RULER_ALL = ("niah", "vt", "cwe", "fwe")
"""RULER task families (the task name's part before ``_``) scored by ``string_match_all``."""
LONGBENCH_F1 = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa")


def kvpress_clean(prediction: str) -> str:
    """kvpress's RULER clean-up: control characters removed, ends stripped."""
    return _CONTROL.sub("", prediction.strip()).strip()


def _numbers_matching(prediction: str, wanted: str | None) -> float:
    """The share of the numbers in ``prediction`` that equal ``wanted`` (0 when it has none)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == wanted for n in numbers) / len(numbers) if numbers and wanted is not None else 0.0


def retrieval_score(prediction: str, answers: Sequence[str]) -> float:
    """LongBench's ``passage_retrieval_en``: the share of numbers written that are the answer's paragraph number."""
    best = 0.0
    for answer in answers:
        found = re.findall(r"Paragraph (\d+)", answer)
        best = max(best, _numbers_matching(prediction.lstrip(), found[0] if found else None))
    return best


def count_score(prediction: str, answers: Sequence[str]) -> float:
    """LongBench's ``passage_count``: the share of numbers written that equal the answer."""
    return max((_numbers_matching(prediction.lstrip(), str(answer)) for answer in answers), default=0.0)


def _first_line_f1(prediction: str, answers: Sequence[str]) -> float:
    return token_f1(prediction.lstrip().split("\n")[0], answers)


def _left_f1(prediction: str, answers: Sequence[str]) -> float:
    return token_f1(prediction.lstrip(), answers)


@dataclass(frozen=True)
class Scorer:
    """A named per-case scorer; ``pass_fail`` when its score is 0 or 1 for cases of one answer
    (``single_only``) or for every case."""

    name: str
    score: Callable[[str, Sequence[str]], float]
    pass_fail: bool = False
    single_only: bool = False

    def binary_for(self, answers: Sequence[str]) -> bool:
        """Whether this scorer gives only 0 or 1 on a case with ``answers``."""
        return self.pass_fail and (not self.single_only or len(answers) == 1)


STRING_MATCH_ALL = Scorer("string_match_all", lambda p, a: string_match_all(kvpress_clean(p), a), True, single_only=True)
STRING_MATCH_PART = Scorer("string_match_part", lambda p, a: string_match_part(kvpress_clean(p), a), True)
DEFAULT_SCORER = STRING_MATCH_ALL
"""The scorer of a file with no ``task`` column (or rows without one)."""
NOT_IMPLEMENTED = {
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum", "needle_in_haystack"), "ROUGE"),
    **dict.fromkeys(("lcc", "repobench-p"), "code similarity (fuzzywuzzy)"),
    **dict.fromkeys(("trec", "lsht"), "classification over a class list"),
    **dict.fromkeys(("multifieldqa_zh", "dureader", "vcsum", "passage_retrieval_zh"), "Chinese segmentation (jieba)"),
}
"""kvpress tasks whose scorer kvlib does not implement, and what it would need."""


def scorer_for(task: str | None) -> Scorer:
    """The scorer of a row of ``task`` (None: :data:`DEFAULT_SCORER`); ``ValueError`` for a task
    whose kvpress scorer is not implemented or that kvlib does not know."""
    if task is None:
        return DEFAULT_SCORER
    if task in NOT_IMPLEMENTED:
        raise ValueError(f"task {task!r} is scored by {NOT_IMPLEMENTED[task]} in kvpress, which kvlib does not implement")
    if task in LONGBENCH_F1:
        return Scorer("qa_f1", _first_line_f1 if task == "triviaqa" else _left_f1)
    if task == "passage_retrieval_en":
        return Scorer("retrieval", retrieval_score)
    if task == "passage_count":
        return Scorer("count", count_score)
    family = task.split("_")[0]
    if family == "qa":
        return STRING_MATCH_PART
    if family in RULER_ALL:
        return STRING_MATCH_ALL
    known = "RULER's niah_*, vt, cwe, fwe, qa_*; LongBench's " + ", ".join((*LONGBENCH_F1, "passage_retrieval_en", "passage_count"))
    raise ValueError(
        f"unknown kvpress task {task!r}: kvlib scores {known}; drop the task column to score every row by {DEFAULT_SCORER.name}"
    )
