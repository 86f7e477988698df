"""SuffixDecoding's proposer: drafts continue the request's own tokens or recent outputs, are no
longer than ``alpha * p``, ``max_draft`` and what the request may still output, the global window
holds at most ``global_tokens`` tokens, and bad options are refused in one line."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.adapters.engine.engine_request import Request
from kvlib.adapters.engine.suffix_speculator import SuffixSpeculation, SuffixSpeculator, speculation


def request(request_id: int, prompt: list[int], output: list[int] = (), max_new_tokens: int = 64) -> Request:
    made = Request(request_id, list(prompt), max_new_tokens)
    made.output = list(output)
    return made


def occurs(text: list[int], pattern: list[int]) -> bool:
    return any(text[i : i + len(pattern)] == pattern for i in range(len(text) - len(pattern) + 1))


def test_a_request_drafts_what_followed_its_last_tokens_before() -> None:
    speculator = SuffixSpeculator(SuffixSpeculation(max_draft=4))
    loop = [10, 11, 12, 13, 14, 15]
    # alpha * p = 3 for a match of 3
    assert speculator.propose(request(0, loop + loop[:3]))[:3] == ([13, 14, 15], 3.0, [])
    assert speculator.propose(request(0, loop + loop[:3], output=[13, 14, 15, 10]))[0] == [11, 12, 13, 14]  # max_draft
    assert speculator.propose(request(1, loop + loop[:3], output=[13], max_new_tokens=3))[0] == [
        14
    ]  # one output left after the bonus token
    assert speculator.requests[0].indexed == len(loop) + 3 + 4  # the second step indexed only the four tokens output since the first


def test_finished_outputs_feed_other_requests_within_the_window() -> None:
    speculator = SuffixSpeculator(SuffixSpeculation(global_tokens=12))
    first = request(0, [1, 2], output=[40, 41, 42, 43, 44, 45])
    speculator.finish(first, finished=True)
    assert speculator.propose(request(1, [7, 40, 41, 42]))[0] == [43, 44, 45]
    speculator.finish(request(2, [1], output=[50] * 5), finished=False)  # aborted: its output is not indexed
    assert speculator.recent.indexed == 6
    speculator.finish(request(3, [1], output=[60, 61, 62, 63, 64, 65, 66]), finished=True)  # 13 > 12: the oldest leaves
    assert speculator.recent.indexed == 7 and speculator.propose(request(4, [7, 40, 41, 42]))[0] == []
    assert speculator.requests.keys() == {1, 4} and speculator.indexed_tokens() == 7 + 4 + 4


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), max_size=3),
    st.lists(st.integers(0, 4), min_size=1, max_size=30),
    st.integers(1, 6),
    st.floats(0.25, 3),
)
def test_every_draft_occurred_after_the_matched_suffix(outputs, prompt, max_draft, alpha) -> None:
    speculator = SuffixSpeculator(SuffixSpeculation(max_draft=max_draft, alpha=alpha, max_match=5, global_tokens=30))
    for number, output in enumerate(outputs):
        speculator.finish(request(number, [0], output=output), finished=True)
    asking = request(99, prompt)
    draft, score, _, _ = speculator.propose(asking)
    assert len(draft) <= max_draft and 0 <= score <= len(draft)
    if draft:
        held = speculator.recent.tokens[: speculator.recent.size].tolist()
        window, start = [], 0
        for length in speculator.recent.lengths:
            window.append(held[start : start + length])
            start += length + 1
        assert sum(map(len, window)) <= 30
        indexed = [prompt, *window]
        matched = max(p for p in range(1, 6) if any(occurs(text, prompt[-p:] + draft) for text in indexed))
        assert len(draft) <= int(alpha * matched)


@pytest.mark.parametrize(
    "value, message",
    [
        ("tree", "speculate must be None, one of"),
        (8, "speculate must be None, one of"),
        (SuffixSpeculation, "speculate must be None, one of"),
    ],
)
def test_bad_speculate_values_are_refused(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        speculation(value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_draft": 0}, "max_draft must be an int >= 1"),
        ({"max_match": True}, "max_match must be an int >= 1"),
        ({"global_tokens": -1}, "global_tokens must be an int >= 0"),
        ({"alpha": 0}, "alpha must be a finite number > 0"),
        ({"min_probability": 1.5}, "min_probability must be a number in"),
        ({"token_cost": -0.1}, "token_cost must be a finite number >= 0"),
        ({"token_cost": float("inf")}, "token_cost must be a finite number >= 0"),
    ],
)
def test_bad_options_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        SuffixSpeculation(**options)
    assert speculation("suffix") == SuffixSpeculation() and speculation(None) is None
