"""``Eviction.reads_kv``: a policy that says it scores without keys and values scores the same
when they are stripped (as after a decode step that attended over the pages), and every
built-in that reads them says so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvlib
from kvlib.policy import LayerView

BATCH, KV_HEADS, GROUP, SLOTS, OBSERVED, DIM = 2, 2, 3, 40, 4, 8


def full_view(seed: int) -> LayerView:
    """A layer view with every ``needs`` field filled (random scores, ragged valid slots)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([[40, 31], [17, 40]])
    valid = torch.arange(SLOTS) < lengths.unsqueeze(-1)
    positions = torch.where(valid, torch.arange(SLOTS).expand(BATCH, KV_HEADS, SLOTS), -1)
    attention = torch.rand(BATCH, KV_HEADS * GROUP, OBSERVED, SLOTS, generator=generator)
    attention = attention.masked_fill(~valid.repeat_interleave(GROUP, 1).unsqueeze(2), 0.0)
    return LayerView(
        layer_idx=1,
        num_layers=4,
        keys=torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=generator),
        values=torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=generator),
        positions=positions,
        valid=valid,
        queries=torch.randn(BATCH, KV_HEADS * GROUP, OBSERVED, DIM, generator=generator),
        query_positions=torch.arange(SLOTS - OBSERVED, SLOTS).expand(BATCH, OBSERVED),
        window_queries=torch.randn(BATCH, KV_HEADS * GROUP, OBSERVED, DIM, generator=generator),
        attention=attention / attention.sum(-1, keepdim=True).clamp(min=1e-9),
        accumulated_attention=torch.rand(BATCH, KV_HEADS, SLOTS, generator=generator).masked_fill(~valid, 0.0),
        prompt_lengths=torch.tensor([SLOTS, SLOTS - 6]),  # row 1: six decode steps in
    )


KEY_FREE = [name for name in kvlib.available_policies()["eviction"] if not kvlib.parse_policy(name).reads_kv]


@pytest.mark.parametrize("name", KEY_FREE)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_key_free_policy_scores_the_same_without_keys_and_values(name: str, seed: int) -> None:
    view = full_view(seed)
    stripped = dataclasses.replace(view, keys=view.keys[..., :0], values=view.values[..., :0])
    assert torch.equal(kvlib.parse_policy(name).score(view), kvlib.parse_policy(name).score(stripped))


def test_built_ins_that_read_keys_or_values_say_so() -> None:
    assert set(KEY_FREE) == {
        "streaming_llm",
        "h2o",
        "snapkv",
        "pyramidkv",
        "tova",
        "random",
        "chunkkv",
        "keyformer",
        "scope",
        "duo_attention",
        "kvzip",
        "windowkv",
        "fastkv",
        "kvcrush",
        "shotkv",
        "kvcompose",
    }
    assert kvlib.parse_policy("chunkkv(inner='knorm')").reads_kv  # a wrapper follows its inner policy
    assert not kvlib.parse_policy("chunkkv(inner='h2o')").reads_kv
    assert kvlib.parse_policy("scope(inner='knorm')").reads_kv
    assert kvlib.parse_policy("kvcrush(inner='knorm')").reads_kv
