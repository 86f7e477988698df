"""What a policy's view gets beyond the stored tokens (adapters/runtime/needs.py): positions
counted from each row's first real token, the call's padding slots, the attention weights the
inner attention returned, only the needs a policy declares. Each need through ``generate``:
tests/adapters/runtime/test_evictor.py."""

from __future__ import annotations

import torch

from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.needs import AttentionInputs, fill_needs, history_after_call, padding_slots, query_positions, returned_weights
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.policy import LayerView
from kvlib.storage.layers.read_cache import LayerRead


def two_rows() -> tuple[LayerStep, torch.Tensor]:
    """Two rows, one head, five slots in position order: a call of 3 new tokens (positions 2..4)
    after 2 stored ones; row 1's first new token (position 2) is padding."""
    positions = torch.arange(5).expand(2, 1, 5).contiguous()
    read = LayerRead(torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4), positions, torch.ones(2, 1, 5, dtype=torch.bool))
    real_new = torch.tensor([[True, True, True], [False, True, True]])  # row 1: position 2 is padding
    return LayerStep(None, 0, read, 2, 3, True), real_new


def test_query_positions_count_from_each_rows_first_real_token() -> None:
    step, real_new = two_rows()
    offsets = torch.tensor([0, 3])
    assert query_positions(step, None, offsets).tolist() == [[2, 3, 4], [-1, 0, 1]]
    assert query_positions(step, real_new, offsets).tolist() == [[2, 3, 4], [-1, 0, 1]]
    assert query_positions(step, real_new, torch.tensor([0, 0])).tolist() == [[2, 3, 4], [-1, 3, 4]]


def test_padding_slots_are_the_calls_padding_tokens_only() -> None:
    step, real_new = two_rows()
    assert padding_slots(step, real_new)[:, 0].tolist() == [[False] * 5, [False, False, True, False, False]]
    assert not padding_slots(step, None).any()


def test_returned_weights_zero_the_rows_of_padding_queries() -> None:
    _, real_new = two_rows()
    weights = torch.ones(2, 2, 3, 5, dtype=torch.float16)
    inputs = AttentionInputs(torch.zeros(2, 2, 3, 4), None, weights, None, real_new)
    kept = returned_weights(inputs, 1)
    assert kept.dtype == torch.float32 and kept.shape == (2, 2, 2, 5)
    assert kept[1, :, :, 0].tolist() == [[1.0, 1.0]] * 2 and returned_weights(inputs, 0)[1, :, 0].sum() == 0


def test_a_policy_that_needs_nothing_gets_nothing() -> None:
    step, real_new = two_rows()
    inputs = AttentionInputs(torch.zeros(2, 2, 3, 4), None, None, None, real_new)
    read = step.read
    view = LayerView(0, 1, read.keys, read.values, read.positions, read.valid)
    fill_needs(
        view,
        StreamingLLM(),
        step,
        inputs,
        torch.zeros(2, dtype=torch.int64),
        None,
        history=None,
        rope=None,
        output_projections=None,
        call_notes={},
    )
    assert view.queries is None and view.attention is None and view.call_notes is None
    assert history_after_call(StreamingLLM(), None, step, inputs, torch.zeros(2, dtype=torch.int64)) is None
