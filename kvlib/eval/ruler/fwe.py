"""RULER's frequent words extraction, ``fwe`` (``scripts/data/synthetic/freq_words_extraction.py``).

A coded text of ``size`` words drawn from a vocabulary of random ``word_length``-letter words, the
word of rank ``k`` repeated ``int(size * k ** -alpha / zeta(alpha))`` times (a Zipf law), shuffled.
The top-ranked word is ``...`` (noise the question says to ignore); the answers are the words of
ranks 2 to 4. RULER's vocabulary has ``(context - tokens_to_generate) // 50`` words.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from kvlib.eval.ruler.task import Prompt, RulerTask

TERMS = 1000
"""Terms summed before :func:`zeta`'s tail correction."""


def zeta(alpha: float) -> float:
    """Riemann zeta of ``alpha > 1``: a partial sum plus its Euler-Maclaurin tail (error below 1e-9)."""
    head = sum(k**-alpha for k in range(1, TERMS))
    return head + TERMS ** (1 - alpha) / (alpha - 1) + TERMS**-alpha / 2 + alpha * TERMS ** (-alpha - 1) / 12


@dataclass(frozen=True)
class FrequentWordsTask(RulerTask):
    """The three most frequent coded words (after the ``...`` noise) of a Zipf-distributed text."""

    name: str = "fwe"
    tokens_to_generate: int = 50
    alpha: float = 2.0
    word_length: int = 6

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alpha <= 1.0:
            raise ValueError(f"{self.name}: alpha must be > 1 (a Zipf exponent), got {self.alpha}")
        if self.word_length < 2:
            raise ValueError(f"{self.name}: word_length must be >= 2, got {self.word_length}")
        if self.vocabulary_size < 5:
            raise ValueError(f"{self.name}: context {self.context} is too small (a vocabulary of at least 5 words needs 250 tokens)")

    @property
    def vocabulary_size(self) -> int:
        return (self.context - self.tokens_to_generate) // 50

    @property
    def min_size(self) -> int:
        """The fewest words for which ranks 2 to 4 each appear, more often than rank 5."""
        size, norm = 1, zeta(self.alpha)
        while not int(size * 4**-self.alpha / norm) > int(size * 5**-self.alpha / norm):
            size += 1
        return size

    def counts(self, size: int) -> list[int]:
        """Occurrences of each rank's word in a text of ``size`` words."""
        norm = zeta(self.alpha)
        return [int(size * k**-self.alpha / norm) for k in range(1, self.vocabulary_size + 1)]

    def prompt(self, size: int, rng: random.Random, tokenizer) -> Prompt:
        vocabulary: set[str] = set()
        while len(vocabulary) < self.vocabulary_size:
            vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=self.word_length)))
        ranked = sorted(vocabulary)
        rng.shuffle(ranked)
        ranked[0] = "..."
        text = [word for word, count in zip(ranked, self.counts(size)) for _ in range(count)]
        rng.shuffle(text)
        message = (
            "Read the following coded text and track the frequency of each coded word. "
            f"Find the three most frequently appeared coded words. {' '.join(text)}\n"
            "Question: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?"
        )
        reply = " Answer: According to the coded text above, the three most frequently appeared words are:"
        return Prompt(message, reply, tuple(ranked[1:4]))
