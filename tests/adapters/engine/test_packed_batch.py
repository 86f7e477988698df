"""The packed batch's verification group: several tokens a row, each attending causally over its
own row's pages, equals SDPA over the dense rows with a causal mask per row, whether the group is
planned once for every layer or appends and attends over its pages layer by layer."""

from __future__ import annotations

import pytest
import torch

from kvlib.adapters.engine.packed_batch import Segment, verify_over_pages, verify_planned
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig

HEADS, KV_HEADS, DIM, LENGTH = 4, 2, 8, 3


def rows_before(store: PagedStore, stored: list[int], generator: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """Sequences holding ``stored`` tokens each (in both layers); their keys and values."""
    seqs, kept = [], []
    for tokens in stored:
        seq = store.new_sequence()
        keys = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        values = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        for layer in range(store.num_layers):
            store.append(layer, [seq], keys, values)
        seqs.append(seq)
        kept.append((keys, values))
    return seqs, kept


def dense_reference(query: torch.Tensor, kept: list, new_keys: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
    """SDPA of each row's ``LENGTH`` queries over its stored tokens and the new ones, causal."""
    outputs = []
    for b, (keys, values) in enumerate(kept):
        keys = torch.cat([keys[0], new_keys[b]], dim=1).repeat_interleave(HEADS // KV_HEADS, dim=0)
        values = torch.cat([values[0], new_values[b]], dim=1).repeat_interleave(HEADS // KV_HEADS, dim=0)
        stored = keys.shape[1]
        mask = torch.arange(stored).view(1, -1) <= torch.arange(stored - LENGTH, stored).view(-1, 1)
        outputs.append(torch.nn.functional.scaled_dot_product_attention(query[b], keys, values, attn_mask=mask))
    return torch.stack(outputs).transpose(1, 2)  # [batch, length, heads, dim]


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "over-pages"])
def test_a_verification_group_attends_causally_over_each_rows_own_pages(planned) -> None:
    generator = torch.Generator().manual_seed(0)
    store = PagedStore(StoreConfig(2, KV_HEADS, DIM, page_size=4, read_cache=False))  # the Engine's default
    stored = [5, 11, 1]
    seqs, kept = rows_before(store, stored, generator)
    positions = torch.tensor([[n + i for i in range(LENGTH)] for n in stored])
    segment = Segment(seqs, 0, LENGTH, positions, verifying=True)
    new_keys = torch.randn(len(seqs), KV_HEADS, LENGTH, DIM, generator=generator)
    new_values = torch.randn(len(seqs), KV_HEADS, LENGTH, DIM, generator=generator)
    query = torch.randn(len(seqs), HEADS, LENGTH, DIM, generator=generator)
    plan = store.plan_step(seqs, LENGTH) if planned else None
    assert (plan is not None) == planned
    for layer in range(store.num_layers):
        if plan is not None:
            plan.pools[layer].format.write_planned(plan, layer, new_keys, new_values)
            output = verify_planned(query, plan, layer, segment, {})
        else:
            store.append(layer, seqs, new_keys, new_values)
            output = verify_over_pages(query, store.paged_layer(layer, seqs), segment, {})
        torch.testing.assert_close(output, dense_reference(query, kept, new_keys, new_values), atol=1e-5, rtol=1e-5)
    assert store.physical_lengths(1, seqs).tolist() == [[n + LENGTH] * KV_HEADS for n in stored]
