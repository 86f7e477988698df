"""The output-length history forecast admission draws from: a request's remaining length is one
of the history's lengths above what it produced, each as likely, capped at its
``max_new_tokens`` (the worst case without such a length), always in ``[1, max_new_tokens -
generated]``; the history keeps its last ``window`` lengths; bad quantiles are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib.adapters.engine.output_lengths import OutputLengths, check_quantile


def draw(lengths: OutputLengths, generated: list[int], max_new_tokens: list[int], draws: list[float]) -> list[int]:
    """One draw per request, ``draws[i]`` picking request ``i``'s."""
    remaining = lengths.sample_remaining(np.array(generated), np.array(max_new_tokens), np.array([draws]))
    assert remaining.shape == (1, len(generated)) and remaining.dtype == np.int64
    return remaining[0].tolist()


def test_a_skewed_history_draws_by_what_a_request_produced() -> None:
    lengths = OutputLengths()
    for length in [4] * 8 + [100, 120]:
        lengths.record(length)
    assert draw(lengths, [0, 0, 0], [200, 200, 200], [0.0, 0.79, 0.85]) == [4, 4, 100]  # 8 in 10 are short
    assert draw(lengths, [10, 10], [200, 200], [0.2, 0.7]) == [90, 110]  # past the short ones: a long one
    assert draw(lengths, [10], [50], [0.9]) == [40]  # capped at its max_new_tokens
    assert draw(lengths, [130], [200], [0.5]) == [70]  # longer than any seen: the worst case
    assert draw(OutputLengths(), [3, 0], [16, 5], [0.5, 0.1]) == [13, 5]  # no history: the worst case


@given(
    st.lists(st.integers(1, 40), max_size=60),
    st.lists(st.tuples(st.integers(0, 39), st.integers(1, 45), st.floats(0.0, 1.0, exclude_max=True)), min_size=1, max_size=6),
    st.integers(1, 20),
)
def test_a_draw_is_a_capped_length_above_what_was_produced_from_the_window(history, requests, window) -> None:
    lengths = OutputLengths(window)
    for length in history:
        lengths.record(length)
    assert len(lengths) == min(len(history), window)
    generated = [g for g, _, _ in requests]
    max_new_tokens = [g + extra for g, extra, _ in requests]
    remaining = draw(lengths, generated, max_new_tokens, [u for _, _, u in requests])
    for left, done, limit, (_, _, u) in zip(remaining, generated, max_new_tokens, requests):
        longer = sorted(length for length in history[-window:] if length > done)
        expected = min(longer[int(u * len(longer))], limit) if longer else limit  # the u-th of the lengths above
        assert left == expected - done
        assert 1 <= left <= limit - done


@pytest.mark.parametrize("quantile", [0, 1.5, -0.1, True, "0.9", None])
def test_bad_quantiles_are_refused(quantile) -> None:
    with pytest.raises(ValueError, match=r"^forecast_quantile must be a number in \(0, 1\], got "):
        check_quantile(quantile)
