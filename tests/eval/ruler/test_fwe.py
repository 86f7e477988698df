"""Frequent words: a Zipf-distributed coded text whose ranks 2 to 4 are the answers."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvlib.eval.ruler import FrequentWordsTask
from kvlib.eval.ruler.fwe import zeta


def test_zeta():
    assert zeta(2.0) == pytest.approx(math.pi**2 / 6, abs=1e-9)
    assert zeta(4.0) == pytest.approx(math.pi**4 / 90, abs=1e-9)


def test_words_follow_the_zipf_counts_and_the_answers_are_ranks_two_to_four(words):
    task = FrequentWordsTask(context=2048, samples=2)
    assert task.vocabulary_size == (2048 - 50) // 50
    for case in task.cases(words):
        text = words.decode(list(case.ids))
        coded = text[text.index("coded words.") + len("coded words.") : text.index("Question:")].split()
        counts = Counter(coded)
        assert sorted(counts.values(), reverse=True) == [c for c in task.counts(case.size) if c]
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == "..." and set(ranked[1:4]) == set(case.answers)
        assert min(counts[a] for a in case.answers) > sorted(counts.values(), reverse=True)[4]
        assert all(len(w) == 6 and w.isalpha() for w in case.answers)


def test_min_size_gives_distinct_answer_counts():
    task = FrequentWordsTask()
    counts = task.counts(task.min_size)
    assert counts[3] > counts[4] and task.counts(task.min_size - 1)[3] <= task.counts(task.min_size - 1)[4]


@pytest.mark.parametrize("settings, message", [({"alpha": 1.0}, "alpha"), ({"context": 200}, "too small")])
def test_bad_settings_are_value_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        FrequentWordsTask(**settings)
