"""Masks over stored slots: physical_mask and real_new_tokens against direct constructions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.masks import allowed, move_position_bias, physical_mask, real_new_tokens
from kvlib.storage.layers.read_cache import LayerRead


def _step(positions: torch.Tensor, query_offset: int, query_length: int) -> LayerStep:
    """A step whose stored tokens have ``positions`` ([B, H, S], -1 for empty slots)."""
    valid = positions >= 0
    batch, heads, slots = positions.shape
    zeros = torch.zeros(batch, heads, slots, 2)
    return LayerStep(None, 0, LayerRead(zeros, zeros, positions, valid), query_offset, query_length, identity=False)


def _causal_padded(padding: list[int], logical: int, queries: int) -> torch.Tensor:
    """A model mask [B, 1, q, logical]: causal, left padding of ``padding[b]`` tokens masked."""
    query_positions = torch.arange(logical - queries, logical).view(-1, 1)
    causal = torch.arange(logical).view(1, -1) <= query_positions
    rows = [causal & (torch.arange(logical) >= pad) for pad in padding]
    return torch.stack(rows).unsqueeze(1)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_physical_mask_looks_each_stored_position_up_in_the_model_mask(data):
    batch, heads, groups = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    logical = data.draw(st.integers(2, 20))
    queries = data.draw(st.integers(1, logical))
    padding = [data.draw(st.integers(0, logical - queries)) for _ in range(batch)]
    slots = data.draw(st.integers(1, logical))
    positions = torch.full((batch, heads, slots), -1)
    for b in range(batch):
        for h in range(heads):
            kept = sorted(data.draw(st.sets(st.integers(0, logical - 1), max_size=slots)))
            positions[b, h, : len(kept)] = torch.tensor(kept, dtype=torch.long)
    model_mask = _causal_padded(padding, logical, queries)
    step = _step(positions, logical - queries, queries)
    got = physical_mask(model_mask, step, heads * groups, None)
    assert got.shape == (batch, heads * groups, queries, slots)
    for b in range(batch):
        for h in range(heads * groups):
            for q in range(queries):
                for s in range(slots):
                    position = int(positions[b, h // groups, s])
                    expected = position >= 0 and bool(model_mask[b, 0, q, position])
                    assert bool(got[b, h, q, s]) == expected
    additive = physical_mask(model_mask, step, heads * groups, torch.float32)
    assert torch.equal(allowed(additive), got)
    assert torch.equal(physical_mask(model_mask.float().log(), step, heads * groups, torch.float16) == 0, got)


def test_without_a_model_mask_visibility_is_causal_in_logical_positions():
    positions = torch.tensor([[[0, 1, 5, 6, 7, -1]]])
    step = _step(positions, query_offset=6, query_length=2)
    got = physical_mask(None, step, 1, None)
    assert got[0, 0].tolist() == [[True, True, True, True, False, False], [True, True, True, True, True, False]]


def test_real_new_tokens_reads_the_diagonal():
    model_mask = _causal_padded([2, 0], logical=6, queries=6)
    step = _step(torch.zeros(2, 1, 6, dtype=torch.long), query_offset=0, query_length=6)
    assert real_new_tokens(model_mask, step).tolist() == [[False, False, True, True, True, True], [True] * 6]
    eager = torch.zeros(model_mask.shape).masked_fill(~model_mask, torch.finfo(torch.float32).min)
    assert torch.equal(real_new_tokens(eager, step), real_new_tokens(model_mask, step))
    assert real_new_tokens(None, step) is None
    decode = _step(torch.zeros(2, 1, 7, dtype=torch.long), query_offset=6, query_length=1)
    assert real_new_tokens(_causal_padded([2, 0], logical=7, queries=1), decode).tolist() == [[True], [True]]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_position_bias_moves_onto_the_slots_holding_each_position(data):
    batch, heads, groups = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    logical, queries, slots = data.draw(st.integers(2, 12)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    positions = torch.tensor(
        data.draw(st.lists(st.integers(-1, logical - 1), min_size=batch * heads * slots, max_size=batch * heads * slots))
    )
    positions = positions.view(batch, heads, slots)
    shared_rows, shared_heads = data.draw(st.booleans()), data.draw(st.booleans())
    bias = torch.randn(1 if shared_rows else batch, 1 if shared_heads else heads * groups, queries, logical)
    kwargs = {"position_bias": bias, "scaling": 0.5}
    move_position_bias(kwargs, _step(positions, logical - queries, queries), heads * groups)
    moved = kwargs["position_bias"]
    assert moved.shape == (batch, heads * groups, queries, slots) and kwargs["scaling"] == 0.5
    for b in range(batch):
        for h in range(heads * groups):
            for s in range(slots):
                position = max(int(positions[b, h // groups, s]), 0)  # an empty slot's is masked away
                source = bias[0 if shared_rows else b, 0 if shared_heads else h, :, position]
                assert torch.equal(moved[b, h, :, s], source)


def test_a_call_without_a_position_bias_is_left_as_it_is():
    kwargs = {"scaling": 0.5}
    move_position_bias(kwargs, _step(torch.tensor([[[3, 1]]]), 3, 1), 2)
    assert kwargs == {"scaling": 0.5}
