"""What a serving replay measured, and the figures drawn from it: output tokens per second over the
makespan, time to first token and time between tokens (percentiles), and greedy agreement between
two systems."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise

from serve_trace import Request


@dataclass
class Replay:
    """One system's run of a trace. For each request, in trace order: the tokens it produced and
    the seconds, since the replay started (the clock of ``Request.arrival_s``), at which each token
    was observed. ``times_s[i]`` has one entry per token of ``tokens[i]``, non-decreasing.
    ``extra`` holds what only that system reports (e.g. the Engine's ``stats()``)."""

    tokens: list[list[int]]
    times_s: list[list[float]]
    extra: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolating linearly between ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(requests: list[Request], replay: Replay) -> dict:
    """Output tokens, makespan (s, from the replay's start to its last token), output tokens/s,
    TTFT p50/p99 (s, first token minus arrival) and TBT p50/p99 (s, between consecutive tokens of
    one request, pooled over requests)."""
    if any(len(t) != len(s) or not t for t, s in zip(replay.tokens, replay.times_s)):
        raise ValueError("every request needs at least one token and one time per token")
    ttft = [times[0] - r.arrival_s for r, times in zip(requests, replay.times_s)]
    tbt = [b - a for times in replay.times_s for a, b in pairwise(times)]
    output_tokens = sum(len(t) for t in replay.tokens)
    makespan = max(times[-1] for times in replay.times_s)
    return {
        "output_tokens": output_tokens,
        "makespan_s": makespan,
        "tokens_per_s": output_tokens / makespan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tbt_p50_s": percentile(tbt, 50) if tbt else 0.0,
        "tbt_p99_s": percentile(tbt, 99) if tbt else 0.0,
    }


def ttft_p50_by_kind(requests: list[Request], replay: Replay) -> dict[str, float]:
    """Median time to first token (s) of each request kind (where prefix sharing shows)."""
    by_kind: dict[str, list[float]] = {}
    for r, times in zip(requests, replay.times_s):
        by_kind.setdefault(r.kind, []).append(times[0] - r.arrival_s)
    return {kind: percentile(values, 50) for kind, values in sorted(by_kind.items())}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many requests two systems answered with identical tokens, and the share of token
    positions (over the longer answer of each pair) that hold the same token."""
    same_positions = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    positions = sum(max(len(ta), len(tb)) for ta, tb in zip(a, b))
    return {
        "requests": len(a),
        "requests_identical": sum(ta == tb for ta, tb in zip(a, b)),
        "tokens_identical": same_positions / positions if positions else 1.0,
    }
