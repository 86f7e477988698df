"""QueryHistory: the last queries of a layer across calls, prompt lengths, attention of the kept
queries; and the evictor keeping it in step with generate (decode steps, beams, new batches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import registry
from kvlib.adapters.runtime.query_history import QueryHistory
from kvlib.policy import Eviction, LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded

HEADS, DIM = 2, 3


def call(positions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries whose first channel is their position (padding: -1), at ``positions`` ``[batch, q_len]``."""
    where = torch.tensor(positions, dtype=torch.int64)
    query = where.float().view(len(positions), 1, -1, 1).expand(-1, HEADS, -1, DIM).clone()
    return query, where


@settings(max_examples=40, deadline=None)
@given(
    padding=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    prompt=st.integers(1, 6),
    steps=st.integers(0, 7),
    count=st.integers(0, 5),
)
def test_the_history_holds_each_rows_last_real_queries(padding, prompt, steps, count):
    """Left-padded prompt (row ``b`` has ``padding[b]`` padding queries), then decode steps: the
    history holds each row's last ``count`` real queries, oldest first, empties (-1) in front."""
    width = max(padding) + prompt
    rows = [[-1] * (width - prompt - p) + [-1] * p + list(range(prompt)) for p in padding]
    rows = [[-1] * (width - len(r)) + r for r in rows]
    query, positions = call(rows)
    history = QueryHistory.empty(query).after_call(query, positions, count)
    assert history.prompt_lengths.tolist() == [prompt] * len(padding)
    for step in range(steps):
        query, positions = call([[prompt + step]] * len(padding))
        history = history.after_call(query, positions, count)
    seen = list(range(prompt + steps))
    expected = ([-1] * count + seen)[len(seen) :] if count else []
    assert history.positions.tolist() == [expected] * len(padding)
    real = history.positions >= 0
    for head in range(HEADS):
        assert torch.equal(history.queries[:, head, :, 0][real].long(), history.positions[real])
    assert history.prompt_lengths.tolist() == [prompt] * len(padding)


def test_a_rolled_back_step_replaces_the_queries_at_and_past_its_position():
    query, positions = call([[0, 1, 2, 3]])
    history = QueryHistory.empty(query).after_call(query, positions, 3)
    query, positions = call([[2]])  # positions 2 and 3 were cropped and 2 runs again
    history = history.after_call(query * 10, positions, 3)
    assert history.positions.tolist() == [[-1, 1, 2]]  # 0 had already left the last three
    assert history.queries[0, 0, -1, 0].item() == 20.0


def test_rows_follow_an_index():
    query, positions = call([[0, 1], [-1, 0]])
    history = QueryHistory.empty(query).after_call(query, positions, 2).rows(torch.tensor([1, 1, 0]))
    assert history.positions.tolist() == [[-1, 0], [-1, 0], [0, 1]]
    assert history.prompt_lengths.tolist() == [1, 1, 2]


def test_attention_matches_a_loop_over_visible_keys():
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, slots, count = 2, 2, 2, 7, 3
    queries = torch.randn(batch, kv_heads * groups, count, 4, generator=generator)
    history = QueryHistory(queries, torch.tensor([[-1, 4, 6], [2, 3, 5]]), torch.tensor([3, 2]))
    keys = torch.randn(batch, kv_heads, slots, 4, generator=generator)
    positions = torch.arange(slots).repeat(batch, kv_heads, 1)
    positions[1, 1] = torch.tensor([0, 1, 3, 4, 5, -1, -1])
    valid = positions >= 0
    got = history.attention(keys, positions, valid, scaling=0.5)
    for b in range(batch):
        for h in range(kv_heads * groups):
            for i in range(count):
                at = int(history.positions[b, i])
                seen = [s for s in range(slots) if valid[b, h // groups, s] and at >= 0 and int(positions[b, h // groups, s]) <= at]
                logits = torch.tensor([float(queries[b, h, i] @ keys[b, h // groups, s]) * 0.5 for s in seen])
                expected = torch.zeros(slots)
                if seen:
                    expected[seen] = torch.softmax(logits, dim=0)
                torch.testing.assert_close(got[b, h, i], expected, rtol=1e-5, atol=1e-6)


@dataclass
class _Recorder(Eviction):
    """Keeps the newest tokens; records the recent query positions and prompt lengths it saw."""

    seen: ClassVar[list] = []
    needs: ClassVar[frozenset[str]] = frozenset({"recent_queries", "prompt_length"})

    def observed_queries(self) -> int:
        return 3

    def score(self, view: LayerView) -> torch.Tensor:
        if view.layer_idx == 0:
            _Recorder.seen.append((view.recent_query_positions.clone(), view.prompt_lengths.clone(), view.recent_attention.shape))
        return view.positions.float().masked_fill(~view.valid, -torch.inf)


def test_the_evictor_keeps_the_history_through_decode_steps_beams_and_resets(scratch_registry):
    registry.register("recorder")(_Recorder)
    model = build_model("llama")
    ids, mask = left_padded([9, 12], seed=3, vocab=model.config.vocab_size)
    cache = kvlib.make_cache(model, "recorder", budget=8, slack=0)  # scored at every decode step
    _Recorder.seen.clear()
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=4, pad_token_id=PAD)
    prompt_positions, lengths, shape = _Recorder.seen[0]
    assert lengths.tolist() == [9, 12] and prompt_positions.tolist() == [[6, 7, 8], [9, 10, 11]]
    assert shape == (2, model.config.num_attention_heads, 3, ids.shape[1])
    last_positions, lengths, _ = _Recorder.seen[-1]
    assert last_positions.tolist() == [[9, 10, 11], [12, 13, 14]] and lengths.tolist() == [9, 12]
    cache.reset()
    _Recorder.seen.clear()
    model.generate(ids[1:, -12:], **cache_argument(cache), do_sample=False, max_new_tokens=3, num_beams=2, pad_token_id=PAD)
    positions, lengths, _ = _Recorder.seen[-1]  # beams: rows forked from the prompt's; nothing of the first run is left
    assert positions.tolist() == [[11, 12, 13], [11, 12, 13]] and lengths.tolist() == [12, 12]


def test_a_policy_that_needs_recent_queries_must_read_keys(scratch_registry):
    @dataclass
    class Blind(Eviction):
        needs: ClassVar[frozenset[str]] = frozenset({"recent_queries"})
        reads_kv: ClassVar[bool] = False

        def score(self, view: LayerView) -> torch.Tensor:
            return view.positions.float()

    with pytest.raises(ValueError, match="reads_kv must be True"):
        registry.register("blind")(Blind)
