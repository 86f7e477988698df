"""benchmarks/serve_trace.py: seeded traces whose shared parts are really shared, arrivals at the
configured rate, lengths within their bounds."""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_trace_module():
    if "serve_trace" not in sys.modules:  # the name serve_bench imports it by
        spec = importlib.util.spec_from_file_location("serve_trace", BENCHMARKS / "serve_trace.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["serve_trace"] = module
        spec.loader.exec_module(module)
    return sys.modules["serve_trace"]


st = _load_trace_module()
VOCAB = 1000


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    config = st.TraceConfig(requests=30)
    assert st.make_trace(config, VOCAB, seed=3) == st.make_trace(config, VOCAB, seed=3)
    assert st.make_trace(config, VOCAB, seed=3).requests != st.make_trace(config, VOCAB, seed=4).requests


def test_system_prompts_and_documents_are_shared_prefixes() -> None:
    trace = st.make_trace(st.TraceConfig(requests=120, weights={"system": 1, "rag": 1}), VOCAB, seed=0)
    users = {}
    for r in trace.requests:
        if r.kind == "system":
            prefix = trace.system_prompts[r.shared[0]]
        else:
            assert 1 <= len(r.shared) <= 3 and len(set(r.shared)) == len(r.shared)
            prefix = [t for d in r.shared for t in trace.documents[d]]
        assert r.prompt_ids[: len(prefix)] == prefix and len(r.prompt_ids) > len(prefix)
        users.setdefault((r.kind, r.shared[0]), []).append(r)
    assert max(len(v) for k, v in users.items() if k[0] == "system") >= 10  # each system prompt reused by many


def test_chat_turn_extends_previous_prompt_by_its_answer_and_a_user_part() -> None:
    config = st.TraceConfig(requests=60, weights={"chat": 1}, turn_delay_s=2.0)
    trace = st.make_trace(config, VOCAB, seed=1)
    sessions = {}
    for r in trace.requests:
        sessions.setdefault(r.session, []).append(r)
    assert any(len(turns) >= 3 for turns in sessions.values())
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
            added = len(after.prompt_ids) - len(before.prompt_ids) - before.max_new_tokens
            assert config.user_len.low <= added <= config.user_len.high
            assert 2.0 <= after.arrival_s - before.arrival_s <= 4.0


def test_arrivals_are_poisson_at_the_configured_rate() -> None:
    trace = st.make_trace(st.TraceConfig(requests=2000, rate=10.0, weights={"system": 1, "rag": 1}), VOCAB, seed=2)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip([0.0] + arrivals, arrivals)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.15)  # exponential: stdev equals the mean


@pytest.mark.parametrize("lengths", [st.Lengths(5, 40), st.Lengths(5, 40, "lognormal", median=12, sigma=1.0)])
def test_lengths_stay_within_bounds_and_reach_both_ends(lengths) -> None:
    draws = [lengths.draw(random.Random(seed)) for seed in range(2000)]
    assert min(draws) == 5 and max(draws) == 40


def test_trace_lengths_and_tokens_within_bounds() -> None:
    config = st.TraceConfig(requests=200)
    trace = st.make_trace(config, VOCAB, seed=5)
    assert len(trace.requests) == 200 and {r.kind for r in trace.requests} == set(st.KINDS)
    for r in trace.requests:
        assert config.output_len.low <= r.max_new_tokens <= config.output_len.high
        assert all(0 <= t < VOCAB for t in r.prompt_ids)
        if r.kind == "system":
            user = len(r.prompt_ids) - len(trace.system_prompts[r.shared[0]])
            assert config.user_len.low <= user <= config.user_len.high
    assert all(config.system_len.low <= len(p) <= config.system_len.high for p in trace.system_prompts)
    assert all(config.document_len.low <= len(d) <= config.document_len.high for d in trace.documents)


def test_bad_configuration_names_the_problem() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        st.Lengths(10, 5)
    with pytest.raises(ValueError, match="lognormal length needs median"):
        st.Lengths(1, 5, "lognormal")
    with pytest.raises(ValueError, match="system, chat, rag"):
        st.TraceConfig(weights={"chats": 1.0})
