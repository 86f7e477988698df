"""The output-length history forecast admission predicts from: the remaining length is the
quantile of the history's lengths above what a request produced, capped at its
``max_new_tokens`` (the worst case without such a length), always in ``[1, max_new_tokens -
generated]``; the history keeps its last ``window`` lengths; bad quantiles are refused."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib.adapters.engine.output_lengths import OutputLengths, check_quantile


def brute_force(history: list[int], generated: int, max_new_tokens: int, quantile: float) -> int:
    longer = sorted(length for length in history if length > generated)
    if not longer:
        return max_new_tokens - generated
    return min(longer[max(math.ceil(quantile * len(longer)), 1) - 1], max_new_tokens) - generated


def test_a_skewed_history_forecasts_by_what_a_request_produced() -> None:
    lengths = OutputLengths()
    for length in [4] * 8 + [100, 120]:
        lengths.record(length)
    assert lengths.remaining(0, 200, 0.5) == 4  # most requests are short
    assert lengths.remaining(0, 200, 0.9) == 100
    assert lengths.remaining(10, 200, 0.5) == 90  # past the short ones: a long one
    assert lengths.remaining(10, 50, 0.5) == 40  # capped at its max_new_tokens
    assert lengths.remaining(130, 200, 0.5) == 70  # longer than any seen: the worst case
    assert OutputLengths().remaining(3, 16, 0.9) == 13  # no history: the worst case


@given(
    st.lists(st.integers(1, 40), max_size=60),
    st.integers(0, 39),
    st.integers(1, 45),
    st.floats(0.01, 1.0),
    st.integers(1, 20),
)
def test_remaining_is_the_capped_conditional_quantile_of_the_window(history, generated, extra, quantile, window) -> None:
    max_new_tokens = generated + extra
    lengths = OutputLengths(window)
    for length in history:
        lengths.record(length)
    assert len(lengths) == min(len(history), window)
    remaining = lengths.remaining(generated, max_new_tokens, quantile)
    assert remaining == brute_force(history[-window:], generated, max_new_tokens, quantile)
    assert 1 <= remaining <= max_new_tokens - generated


@pytest.mark.parametrize("quantile", [0, 1.5, -0.1, True, "0.9", None])
def test_bad_quantiles_are_refused(quantile) -> None:
    with pytest.raises(ValueError, match=r"^forecast_quantile must be a number in \(0, 1\], got "):
        check_quantile(quantile)
