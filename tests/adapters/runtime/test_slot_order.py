"""Slot reuse through ``generate``: a decode step's eviction that moves a token into the evicted
one's slot keeps what the in-order compaction keeps, for every registered eviction policy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.adapters.runtime.slot_order import (
    along_slots,
    ascending,
    keep_all_but,
    ordered_view,
    position_order,
    scores_in_slot_order,
    to_slots,
)
from kvlib.policy import LayerView
from kvlib.registry import available_policies
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model

EVICTIONS = available_policies()["eviction"]
BUDGET, PROMPT, NEW = 24, 40, 20


def generate_held(
    model: torch.nn.Module, spec: str, ids: torch.Tensor, reuse_slots: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    """Greedy tokens under an ``int`` budget held while decoding, each layer's kept positions, and
    whether any head's slots ended out of position order (a slot was reused)."""
    cache = kvlib.make_cache(model, spec, budget=BUDGET, slack=0)  # every decode step evicts (a ring for streaming_llm)
    cache.reuse_slots = reuse_slots
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **cache_argument(cache))
    layers = range(model.config.num_hidden_layers)
    stored = [cache.store.stored_positions(layer, cache._rows) for layer in layers]
    reordered = any(position_order(positions, positions >= 0) is not None for positions in stored)
    return out, [cache.kept_positions(layer) for layer in layers], reordered


@pytest.mark.parametrize("spec", EVICTIONS)
def test_slot_reuse_keeps_what_in_order_compaction_keeps(spec):
    model = build_model("llama")
    ids = torch.randint(3, 97, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tokens, kept, reordered = generate_held(model, spec, ids)
    assert reordered, "no decode step reused a slot: the check would compare in-order runs"
    reference_tokens, reference_kept, reference_reordered = generate_held(model, spec, ids, reuse_slots=False)
    assert not reference_reordered
    assert torch.equal(tokens, reference_tokens)
    for layer, (got, expected) in enumerate(zip(kept, reference_kept)):
        assert torch.equal(got, expected), f"layer {layer}: kept positions differ"  # ascending: equal as sets per head


def test_selection_and_views_follow_positions_not_slots():
    positions = torch.tensor([[[0, 5, 2, 9, -1]]])
    stored = positions >= 0
    order = position_order(positions, stored)
    assert order.tolist() == [[[0, 2, 1, 3, 4]]]
    assert position_order(torch.tensor([[[0, 2, 5, -1]]]), torch.tensor([[[True, True, True, False]]])) is None
    keys = positions.unsqueeze(-1).float().expand(1, 1, 5, 3)
    attention = positions.float().view(1, 1, 1, 5).expand(1, 2, 1, 5)  # two query heads on the KV head
    view = LayerView(0, 1, keys, keys, positions, stored, attention=attention)
    ordered = ordered_view(view, order)
    assert ordered.positions.tolist() == [[[0, 2, 5, 9, -1]]]
    assert ordered.keys[..., 0].tolist() == [[[0, 2, 5, 9, -1]]]
    assert ordered.attention[0, :, 0].tolist() == [[0, 2, 5, 9, -1]] * 2
    assert to_slots(torch.tensor([[[1, 3, -1]]]), order).tolist() == [[[2, 3, -1]]]


@st.composite
def stored_heads(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored positions ``[batch, heads, slots]`` (distinct per head, any slot order, ``-1`` for an
    empty slot) and a bool mask of slots to drop."""
    batch, heads, slots = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 8))
    cells = draw(st.lists(st.integers(-1, 30), min_size=batch * heads * slots, max_size=batch * heads * slots))
    positions = torch.tensor(cells, dtype=torch.int64).view(batch, heads, slots)
    dropped = torch.tensor(draw(st.lists(st.booleans(), min_size=positions.numel(), max_size=positions.numel()))).view_as(positions)
    return positions, dropped


@settings(max_examples=60, deadline=None)
@given(stored_heads())
def test_keep_all_but_lists_each_heads_other_stored_slots_ascending(case) -> None:
    positions, dropped = case
    keep = keep_all_but(positions, dropped)
    assert keep.shape == positions.shape
    for b in range(positions.shape[0]):
        for h in range(positions.shape[1]):
            expected = [s for s in range(positions.shape[-1]) if positions[b, h, s] >= 0 and not dropped[b, h, s]]
            assert keep[b, h].tolist() == expected + [-1] * (positions.shape[-1] - len(expected))


@settings(max_examples=60, deadline=None)
@given(stored_heads())
def test_ascending_sorts_each_head_with_its_padding_last(case) -> None:
    keep, _ = case
    ordered = ascending(keep)
    for b in range(keep.shape[0]):
        for h in range(keep.shape[1]):
            kept = sorted(s for s in keep[b, h].tolist() if s >= 0)
            assert ordered[b, h].tolist() == kept + [-1] * (keep.shape[-1] - len(kept))


def test_scores_in_slot_order_undoes_taking_them_in_position_order() -> None:
    positions = torch.tensor([[[7, 2, -1, 5], [0, 1, 2, 3]]])
    order = torch.sort(torch.where(positions >= 0, positions, 99), dim=-1, stable=True).indices
    scores = torch.tensor([[[0.5, 1.5, -1.0, 2.5], [1.0, 2.0, 3.0, 4.0]]])
    assert torch.equal(scores_in_slot_order(along_slots(scores, order), order), scores)
