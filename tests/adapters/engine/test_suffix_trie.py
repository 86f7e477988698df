"""The depth-bounded suffix trie: counts equal brute-force substring counts however the texts are
indexed, whole removal takes a text out without a trace, and a proposal (longest continued
suffix, then the most frequent path) is always a continuation that occurred in the indexed text."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.adapters.engine.suffix_trie import SuffixNode, SuffixTrie

texts = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def substring_counts(corpus: list[list[int]], depth: int) -> Counter:
    """Occurrences (by start) of every substring of at most ``depth`` tokens of the texts."""
    counts: Counter = Counter()
    for text in corpus:
        for start in range(len(text)):
            for end in range(start + 1, min(len(text), start + depth) + 1):
                counts[tuple(text[start:end])] += 1
    return counts


def trie_counts(trie: SuffixTrie) -> Counter:
    counts: Counter = Counter()

    def walk(node: SuffixNode, path: tuple[int, ...]) -> None:
        for token, child in node.children.items():
            assert child.count > 0
            counts[path + (token,)] = child.count
            walk(child, path + (token,))

    walk(trie.root, ())
    return counts


def occurs(text: list[int], pattern: list[int]) -> bool:
    return any(text[i : i + len(pattern)] == pattern for i in range(len(text) - len(pattern) + 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(texts, min_size=1, max_size=4), st.integers(1, 6), st.data())
def test_counts_equal_brute_force_and_removal_leaves_no_trace(corpus, depth, data) -> None:
    trie = SuffixTrie(depth)
    for text in corpus:  # each text in pieces of random sizes, as a request's output grows
        cursor, done = [], 0
        while done < len(text):
            step = data.draw(st.integers(1, len(text) - done))
            cursor = trie.extend(cursor, text[done : done + step])
            done += step
    expected = substring_counts(corpus, depth)
    assert trie_counts(trie) == expected
    assert trie.nodes == len(expected)
    gone = data.draw(st.integers(0, len(corpus) - 1))
    trie.remove(corpus[gone])
    rest = corpus[:gone] + corpus[gone + 1 :]
    assert trie_counts(trie) == substring_counts(rest, depth)
    assert trie.nodes == len(substring_counts(rest, depth))


@settings(max_examples=80, deadline=None)
@given(texts, st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(2, 8), st.integers(1, 8), st.floats(0, 1))
def test_a_proposal_continues_its_match_as_the_text_did(text, context, depth, max_tokens, min_probability) -> None:
    trie = SuffixTrie(depth)
    trie.extend([], text)
    match = trie.longest_continued_suffix(context, max_length=depth)
    if match is None:  # not even the context's last token occurs followed by anything
        assert not occurs(text[:-1], context[-1:])
        return
    node, length = match
    assert 1 <= length < depth and occurs(text[:-1], context[-length:])
    if length < min(len(context), depth - 1):  # the longest: one token more does not occur continued
        assert not occurs(text[:-1], context[-length - 1 :])
    draft, score = trie.continuation(node, max_tokens, min_probability)
    assert len(draft) <= min(max_tokens, depth - length)
    assert occurs(text, context[-length:] + draft)
    assert 0 <= score <= len(draft)


def test_the_most_frequent_continuation_wins_and_a_rare_one_stops_the_draft() -> None:
    trie = SuffixTrie(8)
    trie.extend([], [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 5])
    node, length = trie.longest_continued_suffix([7, 1, 2], max_length=8)
    assert length == 2
    assert trie.continuation(node, 4, 0.0)[0] == [3, 9, 1, 2]  # 3 follows "1 2" twice, 4 once
    assert trie.continuation(node, 4, 0.9)[0] == []  # 3's share (2/3) is below 0.9


def test_a_bad_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="max_depth must be an int >= 1"):
        SuffixTrie(0)
