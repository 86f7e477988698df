"""Word lists: distinct words, needle keys, made-up words past the lists."""

from __future__ import annotations

import random

from kvlib.eval.ruler.words import ADJECTIVES, NOUNS, VERBS, key_word, word_pool


def test_lists_are_distinct_lower_case_words():
    for words in (NOUNS, ADJECTIVES, VERBS):
        assert len(words) == len(set(words)) > 100 and all(w.isalpha() and w.islower() for w in words)


def test_key_words_are_adjective_noun():
    adjective, noun = key_word(random.Random(1)).split("-")
    assert adjective in ADJECTIVES and noun in NOUNS


def test_word_pool_is_distinct_and_grows_past_the_lists():
    real = set(NOUNS) | set(ADJECTIVES) | set(VERBS)
    small = word_pool(50, random.Random(0))
    assert len(set(small)) == 50 and set(small) <= real
    big = word_pool(len(real) + 300, random.Random(0))
    assert len(set(big)) == len(big) and real <= set(big)
    assert word_pool(50, random.Random(0)) == small
