"""Answer scorers shared by the tasks: passkey match, exact match, substring match and token F1.

Normalisation follows LongBench / SQuAD: lower case, punctuation and articles removed, whitespace
collapsed.
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


SCORERS = {"exact": exact_match, "contains": contains_match, "f1": token_f1}
"""Scorers a :class:`~kvlib.eval.jsonl.JsonlTask` may name."""
