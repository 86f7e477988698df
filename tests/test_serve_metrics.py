"""benchmarks/serve_metrics.py: percentiles, TTFT/TBT/throughput from token timestamps, agreement."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # how serve_bench imports its modules
from serve_metrics import Replay, agreement, percentile, summarize, ttft_p50_by_kind  # noqa: E402
from serve_trace import Request  # noqa: E402


def test_percentile_interpolates_like_inclusive_quantiles() -> None:
    values = [random.Random(0).random() for _ in range(37)]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 50, 99):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)


def test_summarize_measures_from_arrivals_and_token_times() -> None:
    requests = [Request(0.0, [1], 3, "system", 0), Request(1.0, [2], 2, "system", 1)]
    replay = Replay(tokens=[[7, 8, 9], [5, 6]], times_s=[[0.5, 0.7, 1.0], [1.2, 1.5]])
    figures = summarize(requests, replay)
    assert figures["output_tokens"] == 5 and figures["makespan_s"] == 1.5
    assert figures["tokens_per_s"] == pytest.approx(5 / 1.5)
    assert figures["ttft_p50_s"] == pytest.approx(percentile([0.5, 0.2], 50))
    assert figures["tbt_p50_s"] == pytest.approx(0.3) and figures["tbt_p99_s"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="one time per token"):
        summarize(requests, Replay(tokens=[[7], [5]], times_s=[[0.5], []]))


def test_agreement_counts_requests_and_positions() -> None:
    same = agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]])
    assert same == {"requests": 2, "requests_identical": 1, "tokens_identical": 4 / 5}


def test_ttft_by_kind_takes_the_median_of_each_kind() -> None:
    requests = [Request(0.0, [1], 1, "system", 0), Request(1.0, [2], 1, "rag", 1), Request(2.0, [3], 1, "system", 2)]
    replay = Replay(tokens=[[7], [5], [6]], times_s=[[0.5], [1.25], [2.25]])
    assert ttft_p50_by_kind(requests, replay) == {"rag": 0.25, "system": pytest.approx(0.375)}
