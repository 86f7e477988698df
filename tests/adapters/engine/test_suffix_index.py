"""The suffix index: its proposal equals the walk down a suffix tree with occurrence counts (computed
here by brute force over the texts) however the texts were added, extended in pieces and dropped;
it holds exactly its texts, in bounded memory."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.adapters.engine.suffix_index import SEPARATOR, SuffixIndex

texts = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def continued(corpus: list[list[int]], path: list[int]) -> Counter:
    """The token after each occurrence of ``path`` that some token follows, counted, in the order
    each first follows it (text by text, start by start)."""
    following: Counter = Counter()
    for text in corpus:
        for start in range(len(text) - len(path)):
            if text[start : start + len(path)] == path:
                following[text[start + len(path)]] += 1
    return following


def tree_walk(
    corpus: list[list[int]], context: list[int], max_match: int, max_draft: int, alpha: float, min_probability: float
) -> tuple[list[int], float, list[int], list[float]]:
    """SuffixDecoding's proposal from a suffix tree with occurrence counts, by brute force: the
    draft, its score, its extension (the walk on past ``min_probability``, within the length
    limit) and the path's probability at each token of the walk."""
    match = max((p for p in range(1, min(max_match, len(context)) + 1) if continued(corpus, context[-p:])), default=0)
    walk: list[int] = []
    chances: list[float] = []
    probability, score, drafted = 1.0, 0.0, None
    while match and len(walk) < min(max_draft, int(alpha * match)):
        following = continued(corpus, context[-match:] + walk)
        if not following:
            break
        token, count = max(following.items(), key=lambda item: item[1])  # the first of the most frequent
        probability *= count / sum(following.values())
        if drafted is None and probability < min_probability:
            drafted = len(walk)
        walk.append(token)
        chances.append(probability)
        if drafted is None:
            score += probability
    drafted = len(walk) if drafted is None else drafted
    return walk[:drafted], score, walk[drafted:], chances


@settings(max_examples=150, deadline=None)
@given(
    st.lists(texts, min_size=1, max_size=4),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.integers(1, 6),
    st.integers(1, 8),
    st.floats(0.25, 3),
    st.floats(0, 1),
    st.data(),
)
def test_a_proposal_is_the_suffix_tree_walk(corpus, context, max_match, max_draft, alpha, min_probability, data) -> None:
    index = SuffixIndex()
    for text in corpus:  # each text in pieces of random sizes, as a request's output grows
        index.add(text[: data.draw(st.integers(0, len(text)))])
        done = index.lengths[-1]
        while done < len(text):
            step = data.draw(st.integers(1, len(text) - done))
            index.extend(text[done : done + step])
            done += step
    dropped = data.draw(st.integers(0, len(corpus) - 1))
    for _ in range(dropped):
        index.drop_oldest()
    held = corpus[dropped:]
    expected = np.concatenate([np.array([*text, SEPARATOR], dtype=np.int32) for text in held])
    assert np.array_equal(index.tokens[: index.size], expected)
    assert index.indexed == sum(map(len, held))
    assert len(index.tokens) <= max(2 * index.size, index.size + 64)  # the memory bound
    search = {"max_match": max_match, "max_draft": max_draft, "alpha": alpha, "min_probability": min_probability}
    draft, score, extension, chances = index.propose(np.array(context, dtype=np.int32), **search)
    expected_draft, expected_score, expected_extension, expected_chances = tree_walk(held, context, **search)
    assert draft.tolist() == expected_draft and extension.tolist() == expected_extension
    assert score == pytest.approx(expected_score) and chances.tolist() == pytest.approx(expected_chances)


def test_the_most_frequent_continuation_wins_and_a_rare_one_stops_the_draft() -> None:
    index = SuffixIndex()
    index.add([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 5])
    search = {"max_match": 8, "alpha": 2.0}
    draft, score, extension, _ = index.propose(np.array([7, 1, 2], dtype=np.int32), max_draft=4, min_probability=0.0, **search)
    assert draft.tolist() == [3, 9, 1, 2] and extension.tolist() == []  # 3 follows "1 2" twice, 4 once; then as it did
    assert score == pytest.approx(4 * 2 / 3)
    draft, score, extension, _ = index.propose(np.array([7, 1, 2], dtype=np.int32), max_draft=4, min_probability=0.9, **search)
    assert draft.tolist() == [] and score == 0.0 and extension.tolist() == [3, 9, 1, 2]  # 3's share (2/3) is below 0.9


def test_no_match_crosses_from_one_text_into_the_next() -> None:
    index = SuffixIndex()
    index.add([5, 6])
    index.add([7, 8])
    assert index.propose(np.array([6], dtype=np.int32), max_match=4, max_draft=4, alpha=4.0, min_probability=0.0)[0].tolist() == []
    assert index.propose(np.array([5], dtype=np.int32), max_match=4, max_draft=4, alpha=4.0, min_probability=0.0)[0].tolist() == [6]
