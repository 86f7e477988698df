"""adaptive (Ada-KV): a floor per head, then one top-k over the remaining tokens of all heads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.budget.adaptive import Adaptive
from tests.adapters.conftest import build_model
from tests.policies.budget.conftest import check_memory, kept_counts, make_request, run, run_alone

INF, NAN = math.inf, math.nan


def key(score: float) -> tuple[int, float]:
    """Rank of a score, higher kept first: +inf, then finite scores, then NaN and -inf (tied)."""
    if math.isnan(score) or score == -INF:
        return (0, 0.0)
    return (2, 0.0) if score == INF else (1, score)


def adaptive_request(scores: list, candidates: list | None = None, tokens: list[int] | None = None):
    """A request for one layer from nested lists ``scores[batch][heads][slots]``."""
    scores = torch.tensor(scores, dtype=torch.float32)
    candidates = torch.ones_like(scores, dtype=torch.bool) if candidates is None else torch.tensor(candidates)
    counts = candidates.sum(-1)
    tokens = tokens if tokens is not None else [2] * scores.shape[0]
    return make_request(0, 1, tokens, counts.tolist(), scores, candidates)


def check_against_reference(caps: torch.Tensor, scores: torch.Tensor, candidates: torch.Tensor, tokens: list[int], floor: float) -> None:
    """Ada-KV by hand, row by row: each head first keeps its ``floor(floor * B)`` best candidates;
    then one top-k over the remaining candidates of every head takes the rest of ``heads * B``.
    Where scores tie at the top-k's boundary, any split of the tied tokens among heads is valid."""
    batch, heads, slots = scores.shape
    for b in range(batch):
        budget = tokens[b]
        ranked = [sorted((key(float(scores[b, h, i])) for i in range(slots) if candidates[b, h, i]), reverse=True) for h in range(heads)]
        reserved = [min(math.floor(budget * floor), len(keys)) for keys in ranked]
        rest = [keys[r:] for keys, r in zip(ranked, reserved)]
        pool = sorted((k for keys in rest for k in keys), reverse=True)
        taken = min(max(heads * budget - sum(reserved), 0), len(pool))
        got = caps[b].tolist()
        assert sum(got) == sum(reserved) + taken
        if taken == 0:
            assert got == reserved
            continue
        boundary = pool[taken - 1]  # the worst key taken; every better key is taken, ties share the rest
        must = [sum(k > boundary for k in keys) for keys in rest]
        may = [sum(k == boundary for k in keys) for keys in rest]
        for h in range(heads):
            assert reserved[h] + must[h] <= got[h] <= reserved[h] + must[h] + may[h], (b, h, got, reserved, must, may)


SCORE = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, INF, -INF, NAN]),  # ties and the special values
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32),
)


@st.composite
def layers(draw: st.DrawFn):
    batch, heads, slots = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(0, 10))
    size = batch * heads * slots
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    scores = torch.tensor(draw(st.lists(SCORE, min_size=size, max_size=size)), dtype=dtype).view(batch, heads, slots)
    candidates = torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=torch.bool)
    tokens = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    floor = draw(st.one_of(st.sampled_from([0.0, 0.2, 0.5, 1.0]), st.floats(0.0, 1.0)))
    return scores, candidates.view(batch, heads, slots), tokens, floor


@settings(max_examples=150, deadline=None)
@given(layers())
def test_caps_are_floor_plus_one_top_k_across_heads(layer):
    scores, candidates, tokens, floor = layer
    counts = candidates.sum(-1)
    request = make_request(0, 1, tokens, counts.tolist(), scores, candidates)
    caps = Adaptive(floor=floor).caps(request)
    assert caps.dtype == torch.int64 and caps.shape == counts.shape
    heads = counts.shape[1]
    for b, budget in enumerate(tokens):
        guaranteed = torch.clamp(counts[b], max=math.floor(floor * budget))
        assert (caps[b] >= guaranteed).all() and (caps[b] <= counts[b]).all()
        assert int(caps[b].sum()) == min(heads * budget, int(counts[b].sum()))  # the layer's budget, where counts allow
    assert torch.equal(Adaptive(floor=floor).layer_tokens(request), torch.tensor(tokens) * heads)
    check_against_reference(caps, scores, candidates, tokens, floor)


def test_a_head_with_spread_attention_takes_tokens_from_a_concentrated_one():
    concentrated, spread = [0.9, 0.05, 0.03, 0.02], [0.3, 0.25, 0.24, 0.21]
    request = adaptive_request([[concentrated, spread]], tokens=[2])
    assert Adaptive(floor=0.5).caps(request).tolist() == [[1, 3]]  # 1 each, then 0.25 and 0.24 win
    assert Adaptive(floor=0.0).caps(request).tolist() == [[1, 3]]  # 0.9, 0.3, 0.25, 0.24
    assert Adaptive(floor=1.0).caps(request).tolist() == [[2, 2]]  # floor 1: the uniform allocation


def test_infinite_scores_are_taken_first_and_nan_or_minus_infinity_last():
    request = adaptive_request([[[INF, INF, INF, 5.0], [NAN, -INF, NAN, -INF], [4.0, 3.0, 2.0, 1.0]]], tokens=[2])
    assert Adaptive(floor=0.0).caps(request).tolist() == [[4, 0, 2]]
    assert Adaptive(floor=0.5).caps(request).tolist() == [[4, 1, 1]]  # floors, then inf, inf, 5.0
    request = adaptive_request([[[NAN, NAN], [-INF, -1e30]]], tokens=[1])
    assert Adaptive(floor=0.0).caps(request).tolist() in ([[0, 2]], [[1, 1]])  # -1e30, then NaN or -inf


def test_non_candidates_are_never_counted():
    scores = [[[INF, INF, 1.0, 0.0], [0.5, 0.4, 0.3, 0.2]]]
    candidates = [[[False, False, True, True], [True, True, True, True]]]
    caps = Adaptive(floor=0.0).caps(adaptive_request(scores, candidates, tokens=[2]))
    assert caps.tolist() == [[1, 3]]


def test_a_layer_with_fewer_tokens_than_its_budget_keeps_them_all():
    candidates = [[[True, True, False, False], [True, False, False, False]]]
    caps = Adaptive(floor=0.2).caps(adaptive_request([[[1.0, 2.0, 3.0, 4.0]] * 2], candidates, tokens=[3]))
    assert caps.tolist() == [[2, 1]]


def test_rows_have_their_own_budgets():
    scores = [[[4.0, 3.0, 2.0, 1.0], [0.4, 0.3, 0.2, 0.1]]] * 2
    assert Adaptive(floor=0.5).caps(adaptive_request(scores, tokens=[2, 4])).tolist() == [[3, 1], [4, 4]]


def test_parameters_and_spec_round_trip():
    assert kvlib.get_policy("adaptive") is Adaptive and Adaptive.needs_scores
    assert Adaptive().floor == 0.2 and Adaptive().spec() == "adaptive"
    spec = kvlib.parse_spec("tova+adaptive(floor=0.5)")
    assert spec.budget == Adaptive(floor=0.5) and str(spec) == "tova+adaptive(floor=0.5)"
    assert kvlib.parse_spec("tova+adaptive(floor=1)").budget.floor == 1.0
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ValueError, match="floor must be in"):
            kvlib.parse_spec(f"tova+adaptive(floor={bad})")
    with pytest.raises(ValueError, match="'floor' must be float"):
        kvlib.parse_spec("tova+adaptive(floor='half')")


def recording(allocation: Adaptive) -> dict[int, torch.Tensor]:
    """Make ``allocation`` remember the caps it last gave each layer."""
    last: dict[int, torch.Tensor] = {}
    caps = allocation.caps

    def record(request):
        last[request.layer_idx] = result = caps(request)
        return result

    allocation.caps = record
    return last


@pytest.mark.parametrize("eviction", ["knorm", "tova(average='group')"])  # scores that differ between heads
def test_through_generate_heads_share_each_layers_budget(eviction):
    model = build_model("default")
    budget, lengths, floor = 8, [30, 41], 0.25
    allocation = Adaptive(floor=floor)
    last_caps = recording(allocation)
    cache, ids = run(model, [eviction, allocation], budget, lengths, seed=6, new_tokens=3)
    counts = kept_counts(cache)  # [layers, batch, heads]
    heads = cache.shape.num_kv_heads
    assert (counts.sum(-1) == heads * budget).all()  # every layer of every row: heads * B, exactly
    assert (counts >= math.floor(floor * budget)).all()
    assert (counts != budget).any(), "heads should differ"
    for layer in range(cache.shape.num_layers):
        assert torch.equal(counts[layer], last_caps[layer].cpu())  # the engine keeps what the allocation gave
    check_memory(cache, counts)
    if eviction == "knorm":  # scores of a row do not depend on the batch: the padded row keeps what it keeps alone
        alone_cache = run_alone(model, f"{eviction}+adaptive(floor={floor})", budget, ids, 0, lengths[0], new_tokens=3)
        assert torch.equal(counts[:, 0], kept_counts(alone_cache)[:, 0])


def test_through_generate_with_floor_one_is_uniform():
    cache, _ = run(build_model("default"), "knorm+adaptive(floor=1.0)", 6, [25, 33], seed=7, new_tokens=2)
    assert (kept_counts(cache) == 6).all()


def test_make_cache_composes_it_with_an_eviction_policy():
    cache = kvlib.make_cache(build_model("gpt2"), "tova+adaptive(floor=0.5)", budget=16)
    assert cache.evictor.allocation == Adaptive(floor=0.5) and cache.evictor.budget == 16
