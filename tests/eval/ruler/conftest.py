"""A word-level tokenizer for the RULER task tests: one token per whitespace-separated word, with a
chat template that wraps the message in two marker tokens (so template handling is visible)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class WordTokenizer:
    """Ids are word indices in a growing vocabulary; ``instruct`` adds ``<user>`` and ``<assistant>``."""

    vocabulary: dict = None  # type: ignore[assignment]
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocabulary", {"<bos>": 0, "<eos>": 1, "<pad>": 2})

    def __hash__(self) -> int:
        return id(self)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = [self.vocabulary.setdefault(word, len(self.vocabulary)) for word in text.split()]
        return ([0] if bos else []) + ids

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocabulary.items()}
        return " ".join(words[i] for i in ids if i > 2)

    def instruct(self, message: str, reply_start: str = "") -> list[int]:
        return self.encode(f"<user> {message} <assistant> {reply_start}")


@pytest.fixture
def words():
    return WordTokenizer()
