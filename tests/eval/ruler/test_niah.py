"""The four needle tasks: needles where asked, the right wording, the asked keys' values as answers."""

from __future__ import annotations

import re

import pytest

from kvlib.eval.ruler import RULER_TASKS, NiahTask

NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")


def _needles(text: str) -> list[tuple[str, str]]:
    return NEEDLE.findall(text)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_a_single_needle_sits_at_the_depth_asked(words, depth):
    task = NiahTask(context=2048, samples=2, depths=(depth,))
    for case in task.cases(words):
        assert case.depths == (pytest.approx(int(case.size * depth) / case.size),)
        text = words.decode(list(case.ids))
        body = text[text.index("afterwards.") + len("afterwards.") : text.index("What is the special")]
        sentences = [s for s in body.split(".") if s.strip()]
        before = next(i for i, s in enumerate(sentences) if "One of the special magic numbers" in s)
        assert before == int(case.size * depth)


def test_niah_single_asks_for_one_number_in_the_singular(words):
    case = RULER_TASKS["niah_single"](context=1024, samples=1).cases(words)[0]
    text = words.decode(list(case.ids))
    ((key, value),) = _needles(text)
    assert case.answers == (value,)
    assert f"What is the special magic number for {key} mentioned in the provided text?" in text
    assert text.endswith(f"The special magic number for {key} mentioned in the provided text is")
    assert text.startswith("<user> A special magic number is hidden within the following text.")


def test_niah_multikey_asks_one_of_four_keys(words):
    for case in RULER_TASKS["niah_multikey"](context=1024, samples=3).cases(words):
        needles = _needles(words.decode(list(case.ids)))
        assert len(needles) == 4 and len({k for k, _ in needles}) == 4
        asked = re.search(r"number for ([a-z-]+) mentioned", words.decode(list(case.ids))).group(1)
        assert case.answers == (dict(needles)[asked],)


def test_niah_multivalue_asks_all_four_values_of_one_key(words):
    case = RULER_TASKS["niah_multivalue"](context=1024, samples=1).cases(words)[0]
    needles = _needles(words.decode(list(case.ids)))
    assert len(needles) == 4 and len({k for k, _ in needles}) == 1
    assert sorted(case.answers) == sorted(v for _, v in needles)
    assert "What are all the special magic numbers for" in words.decode(list(case.ids))


def test_niah_multiquery_asks_all_four_keys(words):
    case = RULER_TASKS["niah_multiquery"](context=1024, samples=1).cases(words)[0]
    text = words.decode(list(case.ids))
    needles = _needles(text)
    assert len(needles) == 4 and sorted(case.answers) == sorted(v for _, v in needles)
    question = text[text.index("What are all") :]
    assert all(key in question for key, _ in needles) and ", and " in question


def test_noise_haystack_is_rulers_repeated_line(words):
    case = NiahTask(context=1024, samples=1, haystack="noise").cases(words)[0]
    assert words.decode(list(case.ids)).count("The grass is green. The sky is blue.") == case.size


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"keys": 1, "queries": 2}, "queries <= keys"),
        ({"values": 0}, ">= 1"),
        ({"depths": (0.5, 0.5)}, "depths takes 1 fractions"),
        ({"depths": (1.5,)}, "depths takes 1 fractions"),
        ({"haystack": "pg"}, "haystack must be"),
    ],
)
def test_bad_settings_are_value_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        NiahTask(**settings)
