"""RULER's common words extraction, ``cwe`` (``scripts/data/synthetic/common_words_extraction.py``).

A numbered list of ``size`` distinct words, ``common`` of them repeated ``common_repeats`` times and
the rest ``uncommon_repeats`` times, shuffled; the answers are the common words. RULER's
repeats depend on the context: below 4096 tokens 6 and 1 (its solved example: 20 words, 3 and 1),
from 4096 on 30 and 3 (example: 40 words, 10 and 3). One solved example comes first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlib.eval.ruler.task import Prompt, RulerTask
from kvlib.eval.ruler.words import word_pool

LONG_CONTEXT = 4096
"""From this context on (tokens), RULER's larger repeat counts apply."""


@dataclass(frozen=True)
class CommonWordsTask(RulerTask):
    """The ``common`` most repeated words of a numbered list of ``size`` distinct words."""

    name: str = "cwe"
    tokens_to_generate: int = 120
    common: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.common < 1:
            raise ValueError(f"{self.name}: common must be >= 1, got {self.common}")

    @property
    def min_size(self) -> int:
        return self.common + 1

    def repeats(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """``((example words, common repeats, uncommon repeats), (common repeats, uncommon repeats))``."""
        return ((20, 3, 1), (6, 1)) if self.context < LONG_CONTEXT else ((40, 10, 3), (30, 3))

    def prompt(self, size: int, rng: random.Random, tokenizer) -> Prompt:
        (shown_words, shown_common, shown_uncommon), (common, uncommon) = self.repeats()
        shown_list, shown_answers = self._word_list(shown_words, shown_common, shown_uncommon, rng)
        example = self._question(shown_list) + self._reply() + " " + _numbered(shown_answers)
        words, answers = self._word_list(size, common, uncommon, rng)
        return Prompt(example + "\n" + self._question(words), self._reply(), tuple(answers))

    def _word_list(self, size: int, common: int, uncommon: int, rng: random.Random) -> tuple[list[str], list[str]]:
        words = word_pool(max(size, self.common + 1), rng)
        listed = words[: self.common] * common + words[self.common :] * uncommon
        rng.shuffle(listed)
        return listed, words[: self.common]

    def _question(self, words: list[str]) -> str:
        return (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            f"Memorize the ones that appear most often.\n{_numbered(words)}\n"
            f"Question: What are the {self.common} most common words in the above list?"
        )

    def _reply(self) -> str:
        return f" Answer: The top {self.common} words that appear most often in the list are:"


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
