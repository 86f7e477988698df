"""tova: the last query's attention averaged over the layer's query heads (the paper and kvpress),
or over each KV group's query heads (``average="group"``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.eviction.tova import TOVA, by_position_total
from kvlib.policy import LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model


def _view(attention: torch.Tensor, kv_heads: int, positions: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> LayerView:
    batch, _, _, slots = attention.shape
    keys = torch.zeros(batch, kv_heads, slots, 2)
    if positions is None:
        positions = torch.arange(slots).expand(batch, kv_heads, slots)
    if valid is None:
        valid = torch.ones(batch, kv_heads, slots, dtype=torch.bool)
    return LayerView(0, 1, keys, keys, positions, valid, attention=attention)


def _attention(batch: int, query_heads: int, queries: int, slots: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, query_heads, queries, slots, generator=generator), dim=-1)


def kvpress_tova(attention: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """kvpress's TOVAPress.score without its forced last token: the last query's attention,
    mean over every query head, repeated for each KV head."""
    return attention[..., -1:, :].mean(1).repeat(1, kv_heads, 1)


def test_the_default_is_kvpress_layer_wide_average():
    attention = _attention(2, 9, 4, 7)
    scores = TOVA().score(_view(attention, kv_heads=3))
    torch.testing.assert_close(scores, kvpress_tova(attention, 3))
    assert torch.equal(scores[:, 0], scores[:, 1]) and torch.equal(scores[:, 0], scores[:, 2])


def test_group_average_is_a_parameter():
    batch, kv_heads, groups, slots = 2, 2, 3, 6
    attention = _attention(batch, kv_heads * groups, 4, slots)
    scores = TOVA(average="group").score(_view(attention, kv_heads))
    for b in range(batch):
        for h in range(kv_heads):
            expected = attention[b, h * groups : (h + 1) * groups, -1].mean(0)
            torch.testing.assert_close(scores[b, h], expected)
    assert kvlib.parse_spec("tova(average='group')").eviction == TOVA(average="group")
    with pytest.raises(ValueError, match="average"):
        TOVA(average="heads")


def test_only_the_last_query_is_asked_for():
    assert TOVA.needs == frozenset({"attention"}) and TOVA().observed_queries() == 1


@settings(max_examples=40, deadline=None)
@given(data=st.data(), kv_heads=st.integers(1, 3), groups=st.integers(1, 3), slots=st.integers(1, 8))
def test_heads_holding_different_tokens_average_by_position(data, kv_heads, groups, slots):
    """Each KV head holds its own subset of positions (as after per-head budgets): a position's
    score is the attention it gets from every query head holding it, over all query heads."""
    positions, valid = torch.full((1, kv_heads, slots), -1), torch.zeros(1, kv_heads, slots, dtype=torch.bool)
    for head in range(kv_heads):
        held = sorted(data.draw(st.sets(st.integers(0, 11), min_size=1, max_size=slots)))
        positions[0, head, : len(held)] = torch.tensor(held)
        valid[0, head, : len(held)] = True
    attention = _attention(1, kv_heads * groups, 1, slots, seed=data.draw(st.integers(0, 99)))
    attention = attention * valid.repeat_interleave(groups, dim=1).unsqueeze(2)
    scores = TOVA().score(_view(attention, kv_heads, positions, valid))
    for head in range(kv_heads):
        for slot in range(slots):
            if not valid[0, head, slot]:
                continue
            position = positions[0, head, slot]
            total = sum(
                float(attention[0, query_head, -1, (positions[0, query_head // groups] == position).nonzero()[0, 0]])
                for query_head in range(kv_heads * groups)
                if (positions[0, query_head // groups] == position).any()
            )
            assert abs(float(scores[0, head, slot]) - total / (kv_heads * groups)) < 1e-6


def test_by_position_total_ignores_invalid_slots():
    values = torch.tensor([[[1.0, 2.0, 5.0], [10.0, 20.0, 7.0]]])
    positions = torch.tensor([[[0, 3, -1], [3, 4, 0]]])
    valid = torch.tensor([[[True, True, False], [True, True, False]]])
    assert by_position_total(values, positions, valid).tolist() == [[[1.0, 12.0, 0.0], [12.0, 20.0, 0.0]]]


def test_every_head_of_a_layer_keeps_the_same_tokens_through_generate():
    model = build_model("llama")
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = kvlib.make_cache(model, "tova", budget=12, slack=0)
    model.generate(ids, **cache_argument(cache), do_sample=False, max_new_tokens=6, pad_token_id=0)
    grouped = kvlib.make_cache(model, "tova(average='group')", budget=12, slack=0)
    model.generate(ids, **cache_argument(grouped), do_sample=False, max_new_tokens=6, pad_token_id=0)
    differs = False
    for layer in range(cache.shape.num_layers):
        kept = cache.kept_positions(layer)[0]
        assert (kept >= 0).sum(-1).eq(12).all()
        assert all(torch.equal(kept[0], kept[h]) for h in range(kept.shape[0]))
        by_group = grouped.kept_positions(layer)[0]
        differs |= not all(torch.equal(by_group[0], by_group[h]) for h in range(by_group.shape[0]))
    assert differs, "the per-group variant should let heads keep different tokens"
