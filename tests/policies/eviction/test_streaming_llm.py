"""Tests for the StreamingLLM eviction policy (attention sinks + recent window)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import LayerView
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.policy import Eviction

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
    policy = StreamingLLM(sinks=2)
    assert torch.equal(policy.score(view), policy.score(other))


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


@pytest.mark.parametrize("family", ["llama", "default"])
@pytest.mark.parametrize("read_cache", [False, True], ids=["planned", "dense"])
def test_a_held_cap_is_a_ring_each_step_attending_over_the_sinks_and_the_newest(family: str, read_cache: bool) -> None:
    """Under an int budget each decode step first drops the oldest token past the sinks, then
    attends over the cap (StreamingLLM's reference code makes space before each forward): the
    logits equal a full forward over the same tokens whose mask lets decode query ``p`` see the
    sinks and positions ``p - window < j <= p``; the prompt attends causally, as one call. The
    planned path (a ring of slots) and the dense-read path agree."""
    from kvlib.transformers_compat import cache_argument
    from tests.adapters.conftest import assert_same_logits, build_model

    model = build_model(family)
    sinks, window, prompt_length, new = 4, 8, 20, 14
    ids = torch.randint(3, 90, (1, prompt_length), generator=torch.Generator().manual_seed(2))
    cache = kvlib.make_cache(model, "streaming_llm", budget=sinks + window, read_cache=read_cache)
    out = model.generate(
        ids,
        **cache_argument(cache),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        return_dict_in_generate=True,
        output_logits=True,
    )
    sequence = out.sequences
    length = sequence.shape[1]
    query = torch.arange(length).unsqueeze(-1)
    key = torch.arange(length).unsqueeze(0)
    decoding = query >= prompt_length
    visible = (key <= query) & (~decoding | (key < sinks) | (key > query - window))
    mask = torch.zeros(1, 1, length, length).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(sequence, attention_mask=mask).logits[0, prompt_length - 1 : -1]
    assert_same_logits(list(out.logits), [row.unsqueeze(0) for row in logits])
    kept = [*range(sinks), *range(length - 1 - window, length - 1)]  # the last token has no KV yet
    for layer in range(model.config.num_hidden_layers):
        assert cache.kept_positions(layer)[0].tolist() == [kept] * cache.shape.num_kv_heads
