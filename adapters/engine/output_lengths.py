"""The history of output lengths that forecast admission (the Past-Future scheduler) predicts from.

:class:`OutputLengths` keeps the output lengths (tokens) of the last ``window`` finished requests,
sorted. For a running request that has produced ``generated`` tokens of at most
``max_new_tokens``, the distribution of its final length is the history's lengths greater than
``generated`` (it has not ended yet), each as likely, capped at ``max_new_tokens``;
:meth:`OutputLengths.sample_remaining` draws from it, less ``generated``. Without a length above
``generated`` in the history (a cold start, or a request longer than any seen), the draw is the
worst case, ``max_new_tokens - generated``. Invariant: ``1 <= remaining <= max_new_tokens -
generated`` for a request that has not ended (``generated < max_new_tokens``).
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from kvlib.errors import quoted


def check_quantile(quantile: object) -> float:
    """``quantile`` as a float; ``ValueError`` unless it is a number in (0, 1]."""
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile <= 1:
        raise ValueError(f"forecast_quantile must be a number in (0, 1], got {quoted(quantile)}")
    return float(quantile)


class OutputLengths:
    """Output lengths (tokens) of the last ``window`` finished requests, and forecasts from them."""

    def __init__(self, window: int = 1024) -> None:
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self._sorted_array: np.ndarray | None = None
        self.window = window

    def __len__(self) -> int:
        return len(self._order)

    def record(self, length: int) -> None:
        """Add a finished request's output length, dropping the oldest beyond the window."""
        self._order.append(length)
        bisect.insort(self._sorted, length)
        self._sorted_array = None
        if len(self._order) > self.window:
            del self._sorted[bisect.bisect_left(self._sorted, self._order.popleft())]

    def sample_remaining(self, generated: np.ndarray, max_new_tokens: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """Output tokens still to come, drawn: ``[samples, requests]`` (int64) for requests that
        produced ``generated[i]`` of at most ``max_new_tokens[i]`` tokens (``[requests]`` each),
        ``draws[s, i]`` in [0, 1) picking one of the history's lengths above ``generated[i]``
        (see the module docstring)."""
        history = self._array()
        first = np.searchsorted(history, generated, side="right")
        longer = len(history) - first
        if not len(history):
            return np.broadcast_to(max_new_tokens - generated, draws.shape).astype(np.int64)
        picked = first + np.minimum((draws * longer).astype(np.int64), np.maximum(longer - 1, 0))
        lengths = history[np.minimum(picked, len(history) - 1)]
        return np.where(longer > 0, np.minimum(lengths, max_new_tokens), max_new_tokens) - generated

    def _array(self) -> np.ndarray:
        """The sorted history as an int64 array (rebuilt after a record)."""
        if self._sorted_array is None:
            self._sorted_array = np.asarray(self._sorted, dtype=np.int64)
        return self._sorted_array
