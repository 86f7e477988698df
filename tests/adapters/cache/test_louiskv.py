"""``louiskv`` through generate: with ``top_k`` covering every page the output is the untiered
cache's, with pages on the host; a head retrieves only at the first step and where its query drifts
past the threshold (never again at -1, at every step at 1), and each step copies from the host
exactly the off-device pages of its last retrieval and of the pages opened since; the device holds
its page budget and the key summaries; the Engine refuses it (tiering)."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.tiering.louiskv import LouisKV
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.test_shadowkv import (
    assert_budget_on_the_device_the_rest_on_the_host,
    assert_covering_equals_the_untiered_cache,
    generate,
    page_mb,
)
from tests.adapters.conftest import DEFAULT_BYTES, assert_same_logits, build_model, left_padded


@pytest.mark.parametrize("family", ["llama", "default"])
def test_covering_every_page_equals_the_untiered_cache_with_pages_on_the_host(family: str) -> None:
    assert_covering_equals_the_untiered_cache(family, "louiskv(top_k=8, dense_layers=0, placement='lru(device_mb={mb})')")


@pytest.mark.parametrize(("threshold", "retrievals_per_head"), [(-1.0, 1), (1.0, 12)])
def test_retrieval_happens_only_at_boundaries_and_fetches_what_it_reads(threshold: float, retrievals_per_head: int) -> None:
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    policy = kvlib.parse_policy(
        f"louiskv(top_k=3, dense_layers=1, threshold={threshold}, placement='lru(device_mb={page_mb(model, 2, 1)})')"
    )
    cache = kvlib.make_cache(model, policy)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
        for step in range(12):  # crosses a page boundary (160 tokens)
            before = [pool.host_pages_read for pool in cache.store.pools]
            model(input_ids=ids[:, step : step + 1], attention_mask=torch.ones(1, 151 + step, dtype=torch.long), **cache_argument(cache))
            for layer in range(1, layers):
                table, lengths = cache.store.tables[layer].pages[cache.rows[0]], cache.store.tables[layer].lengths[cache.rows[0]]
                used = (lengths + 15).div(16, rounding_mode="floor").unsqueeze(0)
                read = LouisKV.reading(policy.last[layer], used)[0]
                page_ids = torch.cat([table[head, read[head][read[head] >= 0]] for head in range(heads)])
                pool = cache.store.pools[layer]
                assert pool.host_pages_read - before[layer] == int((pool.device_row[page_ids] < 0).sum()), (step, layer)
    assert policy.retrievals == {layer: heads * retrievals_per_head for layer in range(1, layers)}
    assert all(pool.pages_on_device == 2 * heads for pool in cache.store.pools)


def test_the_device_holds_its_page_budget_and_the_key_summaries_the_host_the_rest() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    budget = 3
    cache = kvlib.make_cache(model, f"louiskv(top_k=2, placement='lru(device_mb={page_mb(model, budget, 1)})')")
    generate(model, ids, mask, cache, steps=12)  # 161 tokens: 11 pages per head
    assert_budget_on_the_device_the_rest_on_the_host(cache, model, budget, pages=11)


def test_the_engine_refuses_it_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^the engine does not apply tiering or reuse policies yet \(louiskv\(top_k=2\)\)"):
        kvlib.Engine(build_model("llama"), "louiskv(top_k=2)")


def test_one_object_serves_caches_in_turn_as_fresh_ones_would() -> None:
    """The prompt of each cache forgets the last cache's retrievals."""
    model = build_model("default")
    first, first_mask = left_padded([120], seed=6, vocab=DEFAULT_BYTES)
    second, second_mask = left_padded([130], seed=7, vocab=DEFAULT_BYTES)  # its first step holds the pages the last one did
    spec = "louiskv(top_k=2, dense_layers=1, threshold=0.5)"
    fresh = generate(model, second, second_mask, kvlib.make_cache(model, spec), steps=12)
    policy = kvlib.parse_policy(spec)
    generate(model, first, first_mask, kvlib.make_cache(model, policy), steps=12)
    again = generate(model, second, second_mask, kvlib.make_cache(model, policy), steps=12)
    assert torch.equal(again.sequences, fresh.sequences)
    assert_same_logits(again.logits, fresh.logits)
