"""Common words: the common words repeated as RULER repeats them, a solved example first."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvlib.eval.ruler import CommonWordsTask


def _lists(text: str) -> list[Counter]:
    bodies = re.findall(r"appear most often\. (.*?) Question:", text)
    return [Counter(re.findall(r"\d+\. (\S+)", body)) for body in bodies]


@pytest.mark.parametrize("context, common, uncommon, shown", [(1024, 6, 1, (3, 1)), (4096, 30, 3, (10, 3))])
def test_common_words_repeat_as_ruler_repeats_them(words, context, common, uncommon, shown):
    case = CommonWordsTask(context=context, samples=1).cases(words)[0]
    text = words.decode(list(case.ids))
    example, asked = _lists(text)
    assert len(case.answers) == 10 and all(asked[w] == common for w in case.answers)
    assert all(count == uncommon for w, count in asked.items() if w not in case.answers)
    assert len(asked) == case.size
    assert sorted(set(example.values())) == sorted(set(shown))
    assert "Question: What are the 10 most common words in the above list?" in text
    assert text.endswith("The top 10 words that appear most often in the list are:")


def test_numbering_runs_from_one(words):
    text = words.decode(list(CommonWordsTask(context=1024, samples=1).cases(words)[0].ids))
    body = re.findall(r"appear most often\. (.*?) Question:", text)[1]
    numbers = [int(n) for n in re.findall(r"(\d+)\. ", body)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="common"):
        CommonWordsTask(common=0)
