"""Haystacks: the text the RULER-style tasks hide things in, and where those things go.

``essay``: English prose made of sentences generated from :mod:`.words` by a few sentence patterns
(RULER uses Paul Graham's essays; any fluent filler with no answers in it serves). ``noise``:
RULER's repeated five-sentence line. A haystack is a list of units (sentences or lines); items are
inserted between units, at depths given as fractions of the haystack (0: before the first unit,
1: after the last).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvlib.eval.ruler.words import ADJECTIVES, NOUNS, OPENERS, PREPOSITIONS, VERBS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's ``noise`` haystack line."""

DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))
"""RULER's needle depths: 40 evenly spaced fractions from 0 to 1 (rounded to whole percent)."""

_PATTERNS = (
    "The {a} {n} {v} the {n} {p} the {a} {n}.",
    "{o}, the {n} {v} the {a} {n}.",
    "Every {n} that {v} the {n} was {a}.",
    "Most people think the {n} is {a}, but the {n} {v} it {p} the {n}.",
    "It was {a} to see how the {n} {v} the {n}.",
    "When the {n} {v} the {n}, the {n} became {a}.",
    "Nobody {v} the {a} {n} {p} the {n} that year.",
    "{o}, the {a} {n} and the {a} {n} {v} the {n}.",
)


def essay_sentence(rng: random.Random) -> str:
    """One sentence of essay-like filler (no digits: nothing in it looks like an answer)."""
    pattern = rng.choice(_PATTERNS)
    words = {"a": ADJECTIVES, "n": NOUNS, "v": VERBS, "p": PREPOSITIONS, "o": OPENERS}
    parts, out = pattern.split("{"), []
    for index, part in enumerate(parts):
        if index == 0:
            out.append(part)
            continue
        slot, rest = part.split("}", 1)
        out.append(rng.choice(words[slot]) + rest)
    return "".join(out)


def essay(count: int, rng: random.Random) -> list[str]:
    """``count`` essay sentences."""
    return [essay_sentence(rng) for _ in range(count)]


def insert_at_depths(units: Sequence[str], items: Sequence[str], depths: Sequence[float]) -> tuple[list[str], list[float]]:
    """``units`` with ``items[i]`` inserted at ``depths[i]`` (fractions in [0, 1]) and the depth each
    item landed at: the fraction of the units before it. An item goes before unit
    ``int(len(units) * depth)``, as RULER places needles; items at the same depth keep their order."""
    if len(items) != len(depths):
        raise ValueError(f"{len(items)} items but {len(depths)} depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths are fractions in [0, 1], got {list(depths)}")
    cuts = [int(len(units) * d) for d in depths]
    order = sorted(range(len(items)), key=lambda i: (cuts[i], i))
    out: list[str] = []
    landed = [0.0] * len(items)
    start = 0
    for i in order:
        out.extend(units[start : cuts[i]])
        start = cuts[i]
        landed[i] = cuts[i] / len(units) if units else 0.0
        out.append(items[i])
    out.extend(units[start:])
    return out, landed
