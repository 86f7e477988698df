"""RULER's needle-in-a-haystack tasks: ``niah_single``, ``niah_multikey``, ``niah_multivalue``,
``niah_multiquery`` (``scripts/data/synthetic/niah.py`` and ``synthetic.yaml``).

Needles read "One of the special magic numbers for {key} is: {value}." with an ``adjective-noun``
key and a 7-digit value. ``keys`` needles (at least ``queries``) with ``values`` values each are
shuffled and hidden in the haystack at ``depths`` (default: drawn without replacement from RULER's
40 depths); the question names ``queries`` of the keys and the answers are all their values.
The four names are RULER's configurations on the essay haystack: single (1 key, 1 value),
multikey (4 keys, one asked), multivalue (4 values of one key), multiquery (4 keys, all asked).
RULER's ``niah_single_1`` is ``haystack="noise"``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from kvlib.eval.ruler.haystack import DEPTHS, NOISE, essay, insert_at_depths
from kvlib.eval.ruler.task import Prompt, RulerTask
from kvlib.eval.ruler.words import key_word


@dataclass(frozen=True)
class NiahTask(RulerTask):
    """Needles of ``values`` numbers under each of ``keys`` keys; ``queries`` keys asked for.

    ``haystack``: ``"essay"`` (generated prose, units are sentences) or ``"noise"`` (RULER's
    repeated line); ``depths``: one fraction in [0, 1] per needle (in needle order after the
    shuffle), or ``None`` for RULER's random depths.
    """

    name: str = "niah_single"
    tokens_to_generate: int = 128
    asks_apart: ClassVar[bool] = True
    keys: int = 1
    values: int = 1
    queries: int = 1
    haystack: Literal["essay", "noise"] = "essay"
    depths: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.keys, self.values, self.queries) < 1 or self.queries > self.keys:
            raise ValueError(f"{self.name}: keys, values and queries must be >= 1 and queries <= keys")
        if self.haystack not in ("essay", "noise"):
            raise ValueError(f"{self.name}: haystack must be 'essay' or 'noise', got {self.haystack!r}")
        if self.depths is not None and (len(self.depths) != self.keys * self.values or any(not 0.0 <= d <= 1.0 for d in self.depths)):
            raise ValueError(f"{self.name}: depths takes {self.keys * self.values} fractions in [0, 1], got {self.depths}")

    def prompt(self, size: int, rng: random.Random, tokenizer) -> Prompt:
        keys: list[str] = []
        while len(keys) < self.keys:
            key = key_word(rng)
            if key not in keys:
                keys.append(key)
        values = [[str(rng.randint(10**6, 10**7 - 1)) for _ in range(self.values)] for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        depths = self.depths if self.depths is not None else rng.sample(DEPTHS, len(needles))
        units = essay(size, rng) if self.haystack == "essay" else [NOISE] * size
        text, landed = insert_at_depths(units, needles, depths)
        context = (" " if self.haystack == "essay" else "\n").join(text)
        asked = rng.sample(range(self.keys), self.queries)
        query = keys[asked[0]] if self.queries == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
        answers = tuple(v for i in asked for v in values[i])
        if len(answers) == 1:
            intro = "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards."
            question = f"What is the special magic number for {query} mentioned in the provided text?"
            reply = f" The special magic number for {query} mentioned in the provided text is"
        else:
            intro = (
                "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards."
            )
            question = f"What are all the special magic numbers for {query} mentioned in the provided text?"
            reply = f" The special magic numbers for {query} mentioned in the provided text are"
        return Prompt(f"{intro}\n{context}\n{question}", reply, answers, tuple(landed), question)
