"""h2o: accumulated attention plus a recent window, scored and selected; and through generate,
against an independent step-by-step H2O run on a DynamicCache."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.policies.eviction.h2o import H2O
from kvlib.policy import Eviction, LayerView
from kvlib.selection import select_keep
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

BATCH, HEADS, SLOTS = 2, 3, 10
LENGTHS = [[10, 7, 4], [8, 10, 1]]  # valid tokens per (row, head); the rest are invalid slots at the end


def make_view(lengths=LENGTHS, seed=0) -> LayerView:
    generator = torch.Generator().manual_seed(seed)
    valid = torch.arange(SLOTS) < torch.tensor(lengths).unsqueeze(-1)
    positions = torch.where(valid, torch.arange(SLOTS) * 2 + 5, -1)  # ascending, with gaps: earlier evictions
    keys = torch.randn(BATCH, HEADS, SLOTS, 4, generator=generator)
    accumulated = torch.rand(BATCH, HEADS, SLOTS, generator=generator) * 3
    return LayerView(0, 1, keys, keys.clone(), positions, valid, accumulated_attention=accumulated)


def valid_slots(view: LayerView, b: int, h: int) -> list[int]:
    return [s for s in range(SLOTS) if view.valid[b, h, s]]


@pytest.mark.parametrize("recent", [0, 1, 3, 20])
def test_scores_are_accumulated_attention_with_the_window_above_them(recent):
    view = make_view()
    scores = H2O(recent=recent).score(view)
    assert scores.shape == (BATCH, HEADS, SLOTS)
    for b in range(BATCH):
        row_heavy = []
        row_window = []
        for h in range(HEADS):
            slots = valid_slots(view, b, h)
            window = slots[max(len(slots) - recent, 0) :]
            for s in range(SLOTS):
                if not view.valid[b, h, s]:
                    assert float(scores[b, h, s]) == -math.inf
                elif s not in window:
                    assert float(scores[b, h, s]) == pytest.approx(float(view.accumulated_attention[b, h, s]), rel=1e-6)
                    row_heavy.append(float(scores[b, h, s]))
            window_scores = [float(scores[b, h, s]) for s in window]
            assert all(math.isfinite(x) for x in window_scores)
            assert window_scores == sorted(window_scores) and len(set(window_scores)) == len(window_scores)
            row_window += window_scores
        if row_heavy and row_window:  # every head's window outranks every head's heavy hitters
            assert min(row_window) > max(row_heavy)


def reference_keep(accumulated: list[float], slots: list[int], cap: int, recent: int) -> set[int]:
    """The paper's rule for one head: the newest ``recent`` tokens, then the largest accumulated attention."""
    cap = min(cap, len(slots))
    if cap <= recent:
        return set(slots[len(slots) - cap :]) if cap else set()
    window = slots[max(len(slots) - recent, 0) :]
    older = [s for s in slots if s not in window]
    heavy = sorted(older, key=lambda s: accumulated[s], reverse=True)[: cap - len(window)]
    return set(window) | set(heavy)


@pytest.mark.parametrize("recent", [0, 2, 4])
@pytest.mark.parametrize("cap", [1, 3, 5, 8, 12])
def test_select_keep_keeps_the_window_and_the_heavy_hitters(recent, cap):
    view = make_view(seed=1)
    scores = H2O(recent=recent).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, HEADS), cap))
    for b in range(BATCH):
        for h in range(HEADS):
            got = {int(s) for s in kept[b, h] if s >= 0}
            accumulated = view.accumulated_attention[b, h].tolist()
            assert got == reference_keep(accumulated, valid_slots(view, b, h), cap, recent), (b, h)


def test_budget_below_the_window_keeps_the_newest_tokens():
    view = make_view(seed=2)
    scores = H2O(recent=8).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, HEADS), 3))
    assert {int(s) for s in kept[0, 0]} == {7, 8, 9}
    assert {int(s) for s in kept[1, 1]} == {7, 8, 9}
    assert {int(s) for s in kept[0, 2]} == {1, 2, 3}


def test_invalid_slots_inside_a_head_are_skipped():
    view = make_view(seed=3)
    view.valid[0, 0, 8] = False  # a hole: slot 8 is no stored token
    scores = H2O(recent=2).score(view)
    kept = select_keep(scores, view.valid, torch.full((BATCH, HEADS), 2))
    assert {int(s) for s in kept[0, 0]} == {7, 9}
    assert float(scores[0, 0, 8]) == -math.inf


def test_parameters_are_validated():
    with pytest.raises(ValueError, match="recent must be >= 0, got -1"):
        H2O(recent=-1)
    with pytest.raises(kvlib.SpecError, match="recent must be >= 0"):
        kvlib.parse_spec("h2o(recent=-1)")
    with pytest.raises(kvlib.SpecError, match="'recent' must be int"):
        kvlib.parse_spec("h2o(recent=1.5)")
    with pytest.raises(kvlib.SpecError, match="h2o has no parameter 'sinks'"):
        kvlib.parse_spec("h2o(sinks=4)")


def test_spec_round_trip_and_registration():
    assert kvlib.parse_policy("h2o").spec() == "h2o"
    policy = kvlib.parse_policy("h2o(recent=8)")
    assert policy == H2O(recent=8) and policy.spec() == "h2o(recent=8)"
    assert kvlib.parse_policy(policy.spec()) == policy
    assert H2O().recent == 32
    assert kvlib.get_policy("h2o") is H2O and issubclass(H2O, Eviction)
    assert H2O.needs == frozenset({"accumulated_attention"})


# -- through generate -------------------------------------------------------------------------


def reference_generate(model, ids: torch.Tensor, budget: int, recent: int, new_tokens: int):
    """Greedy decoding with H2O done by hand: full eager attention weights from a DynamicCache,
    accumulated per KV head (mean over its query heads, summed over queries), and after each
    forward every layer over budget keeps its newest ``recent`` tokens plus its top accumulated
    attention, gathered per head. Returns the generated ids, each layer's kept positions, and the
    smallest gap between the last heavy hitter kept and the best one evicted (over every choice)."""
    config = model.config
    heads, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    cache = DynamicCache(config=config)
    accumulated = [torch.zeros(heads, 0) for _ in range(config.num_hidden_layers)]
    positions = [torch.zeros(heads, 0, dtype=torch.long) for _ in range(config.num_hidden_layers)]
    tokens, length, generated, margin = ids, ids.shape[1], [], math.inf
    for _ in range(new_tokens):
        first = length - tokens.shape[1]
        new = torch.arange(first, length)
        with torch.no_grad():
            out = model(tokens, **cache_argument(cache), position_ids=new[None], use_cache=True, output_attentions=True)
        for layer, weights in enumerate(out.attentions):  # [1, query_heads, queries, stored]
            received = weights[0].float().sum(1).view(heads, group, -1).mean(1)
            accumulated[layer] = torch.cat([accumulated[layer], torch.zeros(heads, len(new))], 1) + received
            positions[layer] = torch.cat([positions[layer], new.expand(heads, -1)], 1)
            stored = positions[layer].shape[1]
            if stored > budget:
                older = accumulated[layer][:, : stored - recent].sort(-1, descending=True)
                heavy = older.indices[:, : budget - recent]
                margin = min(margin, float((older.values[:, budget - recent - 1] - older.values[:, budget - recent]).min()))
                window = torch.arange(stored - recent, stored).expand(heads, -1)
                keep = torch.cat([heavy, window], 1).sort(-1).values
                accumulated[layer] = accumulated[layer].gather(1, keep)
                positions[layer] = positions[layer].gather(1, keep)
                kv = cache.layers[layer]
                kv.keys = kv.keys.gather(2, keep[None, :, :, None].expand(-1, -1, -1, kv.keys.shape[-1]))
                kv.values = kv.values.gather(2, keep[None, :, :, None].expand(-1, -1, -1, kv.values.shape[-1]))
        tokens = out.logits[:, -1:].argmax(-1)
        generated.append(int(tokens))
        length += 1
    return generated, positions, margin


@pytest.mark.parametrize(
    "prompt, budget, recent, seed",
    [(10, 12, 4, 5), (14, 10, 5, 5)],  # eviction from the 3rd decode step on; eviction at prefill too
)
def test_accumulated_attention_through_generate_matches_a_hand_run(prompt, budget, recent, seed):
    """On the embedded default model (trained weights: attention is far from uniform, so heavy
    hitters differ by layer and head; keeping by the current step's attention alone would keep
    other tokens)."""
    new_tokens = 10
    ids, mask = left_padded([prompt], seed=seed)
    expected_ids, expected_positions, margin = reference_generate(build_model("default", "eager"), ids, budget, recent, new_tokens)
    assert margin > 5e-5  # no near-ties: float rounding cannot flip a choice (a previous-token head makes many)
    heavy = budget - recent
    assert any(not torch.equal(kept[:, :heavy], torch.arange(heavy).expand(kept.shape[0], -1)) for kept in expected_positions)

    model = build_model("default", "eager")
    cache = kvlib.make_cache(model, f"h2o(recent={recent})", budget=budget, slack=0)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=new_tokens, pad_token_id=PAD)
    assert out[0, prompt:].tolist() == expected_ids
    for layer in range(cache.shape.num_layers):
        assert torch.equal(cache.kept_positions(layer)[0], expected_positions[layer]), layer
