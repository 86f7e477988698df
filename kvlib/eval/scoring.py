"""Answer scorers shared by the tasks: passkey match, exact match, substring match, token F1 and
RULER's string matches.

Normalisation follows LongBench / SQuAD: lower case, punctuation and articles removed, whitespace
collapsed. RULER's scorers only lower-case (``scripts/eval/synthetic/constants.py``) and read the
prediction after :func:`ruler_postprocess`.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def first_number(text: str) -> str | None:
    """The first run of digits in ``text``, or None."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def passkey_match(prediction: str, key: str) -> bool:
    """The first number in the prediction is exactly the key (a longer number does not count)."""
    return first_number(prediction) == key


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised answer."""
    return float(any(normalize(prediction) == normalize(a) for a in answers))


def contains_match(prediction: str, answers: Sequence[str]) -> float:
    """RULER's string match: the fraction of answers found (normalised) in the prediction."""
    found = [normalize(a) in normalize(prediction) for a in answers]
    return sum(found) / len(found) if found else 0.0


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """LongBench's QA F1: the best bag-of-words F1 between the prediction and any answer."""
    predicted = normalize(prediction).split()
    best = 0.0
    for answer in answers:
        truth = normalize(answer).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's clean-up of a prediction: control characters become newlines, ends stripped."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of answers contained in the prediction (case-insensitive)."""
    if not answers:
        return 0.0
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_part`` (its QA score): 1.0 when any answer is contained in the prediction."""
    return float(any(a.lower() in prediction.lower() for a in answers))


SCORERS = {
    "exact": exact_match,
    "contains": contains_match,
    "f1": token_f1,
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}
"""Scorers a :class:`~kvlib.eval.jsonl.JsonlTask` may name."""
