"""The history of output lengths that forecast admission (the Past-Future scheduler) predicts from.

:class:`OutputLengths` keeps the output lengths (tokens) of the last ``window`` finished requests,
sorted. For a running request that has produced ``generated`` tokens of at most
``max_new_tokens``, the distribution of its final length is the history's lengths greater than
``generated`` (it has not ended yet), capped at ``max_new_tokens``; :meth:`OutputLengths.remaining`
is that distribution's ``quantile``, less ``generated``. Without a length above ``generated`` in
the history (a cold start, or a request longer than any seen), the forecast is the worst case,
``max_new_tokens - generated``. Invariant: ``1 <= remaining <= max_new_tokens - generated``.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

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
        self.window = window

    def __len__(self) -> int:
        return len(self._order)

    def record(self, length: int) -> None:
        """Add a finished request's output length, dropping the oldest beyond the window."""
        self._order.append(length)
        bisect.insort(self._sorted, length)
        if len(self._order) > self.window:
            del self._sorted[bisect.bisect_left(self._sorted, self._order.popleft())]

    def remaining(self, generated: int, max_new_tokens: int, quantile: float) -> int:
        """Output tokens a request that produced ``generated`` of at most ``max_new_tokens`` still
        produces: the ``quantile`` of the history's lengths above ``generated``, capped (see the
        module docstring)."""
        first = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - first
        if longer == 0:
            return max_new_tokens - generated
        length = self._sorted[first + max(math.ceil(quantile * longer), 1) - 1]
        return min(length, max_new_tokens) - generated
