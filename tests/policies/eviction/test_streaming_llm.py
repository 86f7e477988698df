"""Tests for the StreamingLLM eviction strategy (attention sinks + recent window)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import LayerView
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.strategy import Eviction

BATCH, HEADS, SLOTS, DIM = 2, 3, 10, 4
# valid tokens per (batch, head); the rest of each head's slots are invalid padding at the end
LENGTHS = [[10, 7, 5], [8, 10, 6]]


def make_view(valid: torch.Tensor) -> LayerView:
    batch, heads, slots = valid.shape
    rank = valid.long().cumsum(-1) - 1
    positions = torch.where(valid, rank + 100, torch.full_like(rank, -1))  # absolute positions, -1 invalid
    generator = torch.Generator().manual_seed(0)
    return LayerView(
        layer_idx=0,
        num_layers=1,
        keys=torch.randn(batch, heads, slots, DIM, generator=generator),
        values=torch.randn(batch, heads, slots, DIM, generator=generator),
        positions=positions,
        valid=valid,
    )


def prefix_mask(lengths) -> torch.Tensor:
    lengths = torch.tensor(lengths)
    return torch.arange(SLOTS) < lengths.unsqueeze(-1)


def kept_slots(scores: torch.Tensor, valid: torch.Tensor, k: int) -> list[list[set[int]]]:
    """Per (batch, head): the slots of the top-k scores among valid slots."""
    masked = torch.where(valid, scores, torch.full_like(scores, -torch.inf))
    top = masked.topk(k, dim=-1).indices
    return [[set(top[b, h].tolist()) for h in range(valid.shape[1])] for b in range(valid.shape[0])]


def expected_slots(valid_row: torch.Tensor, sinks: int, window: int) -> set[int]:
    slots = valid_row.nonzero().flatten().tolist()
    return set(slots[:sinks]) | set(slots[len(slots) - window :] if window else [])


@pytest.mark.parametrize("sinks, window", [(2, 3), (2, 1), (1, 4), (4, 1), (2, 0), (0, 5), (0, 1), (5, 0)])
def test_top_k_keeps_sinks_and_recent_window(sinks, window):
    valid = prefix_mask(LENGTHS)
    view = make_view(valid)
    scores = StreamingLLM(sinks=sinks).score(view)
    kept = kept_slots(scores, valid, sinks + window)
    for b in range(BATCH):
        for h in range(HEADS):
            length = LENGTHS[b][h]
            expected = set(range(sinks)) | set(range(length - window, length))
            assert kept[b][h] == expected, (b, h)
            assert kept[b][h] == expected_slots(valid[b, h], sinks, window)


def test_score_shape_dtype_and_invalid_slots():
    valid = prefix_mask(LENGTHS)
    view = make_view(valid)
    scores = StreamingLLM(sinks=2).score(view)
    assert scores.shape == (BATCH, HEADS, SLOTS)
    assert scores.dtype.is_floating_point
    assert torch.all(scores[~valid] == -torch.inf)
    assert torch.all(scores[valid] > -torch.inf)
    assert not torch.isnan(scores).any()


def test_sinks_score_above_every_other_valid_slot():
    valid = prefix_mask(LENGTHS)
    scores = StreamingLLM(sinks=2).score(make_view(valid))
    for b in range(BATCH):
        for h in range(HEADS):
            length = LENGTHS[b][h]
            head = scores[b, h, :length]
            assert head[:2].min() > head[2:].max()
            # after the sinks, a later slot always scores higher (recency)
            assert torch.all(head[3:] > head[2:-1])


def test_sinks_zero_is_pure_recency():
    valid = prefix_mask(LENGTHS)
    scores = StreamingLLM(sinks=0).score(make_view(valid))
    for b in range(BATCH):
        for h in range(HEADS):
            head = scores[b, h, : LENGTHS[b][h]]
            assert torch.all(torch.isfinite(head))
            assert torch.all(head[1:] > head[:-1])
    kept = kept_slots(scores, valid, 3)
    assert kept[0][0] == {7, 8, 9}
    assert kept[1][2] == {3, 4, 5}


def test_more_sinks_than_tokens_keeps_all_valid():
    valid = prefix_mask(LENGTHS)
    scores = StreamingLLM(sinks=SLOTS + 5).score(make_view(valid))
    assert torch.all(scores[valid] == torch.inf)
    assert torch.all(scores[~valid] == -torch.inf)


def test_ignores_keys_values_and_positions():
    valid = prefix_mask(LENGTHS)
    view = make_view(valid)
    other = make_view(valid)
    other.keys = -view.keys * 7
    other.values = torch.zeros_like(view.values)
    other.positions = torch.where(valid, view.positions * 3, view.positions)
    strategy = StreamingLLM(sinks=2)
    assert torch.equal(strategy.score(view), strategy.score(other))


def test_invalid_slots_inside_a_head_are_skipped():
    valid = prefix_mask(LENGTHS)
    valid[0, 0, 1] = False  # a hole: slot 1 is not a stored token
    valid[1, 1, 5] = False
    scores = StreamingLLM(sinks=2).score(make_view(valid))
    kept = kept_slots(scores, valid, 4)
    assert kept[0][0] == {0, 2, 8, 9}
    assert kept[1][1] == {0, 1, 8, 9}
    assert scores[0, 0, 1] == -torch.inf


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=SLOTS), min_size=HEADS * BATCH, max_size=HEADS * BATCH),
    sinks=st.integers(min_value=0, max_value=SLOTS),
    window=st.integers(min_value=0, max_value=SLOTS),
)
def test_top_k_property(lengths, sinks, window):
    lengths = [lengths[:HEADS], lengths[HEADS:]]
    valid = prefix_mask(lengths)
    scores = StreamingLLM(sinks=sinks).score(make_view(valid))
    assert torch.all(scores[~valid] == -torch.inf)
    for b in range(BATCH):
        for h in range(HEADS):
            length = lengths[b][h]
            k = min(sinks + window, length)
            if k == 0:
                continue
            top = set(scores[b, h].topk(k).indices.tolist())
            s = min(sinks, length)
            w = k - s
            assert top == set(range(s)) | set(range(length - w, length))


def test_negative_sinks_rejected():
    with pytest.raises(ValueError, match="sinks must be >= 0, got -1"):
        StreamingLLM(sinks=-1)
    with pytest.raises(kvlib.SpecError, match="sinks must be >= 0"):
        kvlib.parse_spec("streaming_llm(sinks=-1)")


def test_declares_no_needs_and_is_registered():
    assert StreamingLLM.needs == frozenset()
    assert StreamingLLM().needs == frozenset()
    assert issubclass(StreamingLLM, Eviction)
    assert StreamingLLM.kind == "eviction"
    assert StreamingLLM.name == "streaming_llm"
    assert kvlib.get_policy("streaming_llm") is StreamingLLM
    assert StreamingLLM().sinks == 4
