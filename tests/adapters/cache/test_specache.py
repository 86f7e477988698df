"""``specache`` through generate: with ``top_k`` covering every page the output is the untiered
cache's, with pages on the host and on disk; each sparse decode step reads from the host exactly
the pages its layer chose at the previous step (and its newest) that lie off the device; the device
holds its page budget and the key summaries, the host the rest; the Engine refuses it (tiering)."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.tiering.specache import SpeCache
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
    assert_covering_equals_the_untiered_cache(family, "specache(top_k=8, dense_layers=0, placement='lru(device_mb={mb})')")


def test_pages_on_host_and_disk_are_read_where_they_lie(tmp_path) -> None:
    model = build_model("default")
    ids, mask = left_padded([75, 50], seed=3, vocab=DEFAULT_BYTES)
    reference = generate(model, ids, mask, steps=8)
    placement = f"lru(device_mb=0.001, host_mb=0.001, disk={str(tmp_path)!r}, disk_mb=16)"
    cache = kvlib.make_cache(model, f"specache(top_k=8, dense_layers=0, placement={placement!r})")
    out = generate(model, ids, mask, cache, steps=8)
    assert torch.equal(out.sequences, reference.sequences)
    report = cache.memory_report()["by_tier"]
    assert report["host"] > 0 and report["disk"] > 0
    assert all(pool.pages_on_disk > 0 for pool in cache.store.pools)


def test_the_speculated_pages_are_fetched_while_the_step_that_chose_them_computes(tmp_path) -> None:
    """SpeCache's overlap: right after a layer's sparse step the store's prefetcher starts
    fetching the host and disk pages the layer chose for its next step (``expected_pages``), and
    that step takes them from the prefetch; a layer read by selection is never fetched whole
    (each request after the first step names at most ``top_k`` pages a head). Nothing else
    changes: tokens and logits equal the same cache's without prefetch."""
    model = build_model("default")
    heads, top_k = model.config.num_key_value_heads, 3
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)

    def run(prefetch: bool):
        mb = page_mb(model, 2, 1)
        placement = f"lru(device_mb={mb}, host_mb={mb}, disk={str(tmp_path / str(prefetch))!r}, disk_mb=16, prefetch={prefetch})"
        cache = kvlib.make_cache(model, f"specache(top_k={top_k}, dense_layers=1, placement={placement!r})")
        requested: dict[int, list[int]] = {}
        for layer, pool in enumerate(cache.store.pools):  # record each prefetch request's size, then make it
            pool.prefetch = lambda ids, prefetcher, layer=layer, make=pool.prefetch: (
                requested.setdefault(layer, []).append(ids.numel()),
                make(ids, prefetcher),
            )
        return cache, generate(model, ids, mask, cache, steps=12), requested

    cache, out, requested = run(True)
    plain_cache, plain, _ = run(False)
    assert torch.equal(out.sequences, plain.sequences)
    assert_same_logits(out.logits, plain.logits)
    assert cache.store.prefetcher is not None and plain_cache.store.prefetcher is None
    sparse_layers = range(1, model.config.num_hidden_layers)
    assert all(cache.store.pools[layer].prefetched_pages_read > 0 for layer in sparse_layers)
    assert all(pool.pages_on_disk > 0 for pool in cache.store.pools)
    for layer in sparse_layers:
        assert len(requested[layer]) >= 10 and max(requested[layer][1:]) <= top_k * heads, (layer, requested[layer])


class RecordingSpeCache(SpeCache):
    """``specache`` that records, per layer, what each sparse step read and chose."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reads: dict[int, list[torch.Tensor]] = {}
        self.choices: dict[int, list[torch.Tensor]] = {}

    def select_pages(self, layer_idx, query, key_min, key_max, pages_used):
        read = super().select_pages(layer_idx, query, key_min, key_max, pages_used)
        self.reads.setdefault(layer_idx, []).append(read)
        self.choices.setdefault(layer_idx, []).append(self.speculated[layer_idx].chosen)
        return read


def test_each_step_fetches_from_the_host_the_pages_chosen_at_the_step_before(scratch_registry) -> None:
    kvlib.register("specache_recording")(RecordingSpeCache)
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    policy = RecordingSpeCache(top_k=3, dense_layers=1, placement=f"lru(device_mb={page_mb(model, 2, 1)})")
    cache = kvlib.make_cache(model, policy)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
        for step in range(12):  # crosses a page boundary (160 tokens)
            before = [pool.host_pages_read for pool in cache.store.pools]
            feed = ids[:, step : step + 1]
            model(input_ids=feed, attention_mask=torch.ones(1, 151 + step, dtype=torch.long), **cache_argument(cache))
            for layer in range(1, layers):
                read, chosen_before = policy.reads[layer][-1], policy.choices[layer][-2] if step else None
                table = cache.store.tables[layer].pages[cache.rows[0]]
                used = cache.store.tables[layer].lengths[cache.rows[0]].add(15).div(16, rounding_mode="floor")
                if chosen_before is not None:  # the speculated pages and the newest, nothing else
                    for head in range(heads):
                        expected = {int(p) for p in chosen_before[0, head] if p >= 0} | {int(used[head]) - 1}
                        assert {int(p) for p in read[0, head] if p >= 0} == expected
                pool = cache.store.pools[layer]
                page_ids = torch.stack([table[head, read[0, head][read[0, head] >= 0]] for head in range(heads)]).flatten()
                off_device = int((pool.device_row[page_ids] < 0).sum())
                assert pool.host_pages_read - before[layer] == off_device, (step, layer)
    assert all(pool.pages_on_device == 2 * heads for pool in cache.store.pools)
    assert 0 not in policy.reads  # the dense layer reads every page and chooses none


def test_the_device_holds_its_page_budget_and_the_key_summaries_the_host_the_rest() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    budget = 3
    cache = kvlib.make_cache(model, f"specache(top_k=2, placement='lru(device_mb={page_mb(model, budget, 1)})')")
    generate(model, ids, mask, cache, steps=12)  # 161 tokens: 11 pages per head
    assert_budget_on_the_device_the_rest_on_the_host(cache, model, budget, pages=11)


def test_the_engine_refuses_it_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^the engine does not apply tiering or reuse policies yet \(specache\(top_k=2\)\)"):
        kvlib.Engine(build_model("llama"), "specache(top_k=2)")


def test_eviction_with_specache_is_refused() -> None:
    with pytest.raises(ValueError, match="does not combine with eviction"):
        kvlib.make_cache(build_model("llama"), "snapkv+specache", budget=32)


def test_one_object_serves_caches_in_turn_as_fresh_ones_would() -> None:
    """The prompt of each cache forgets what the object chose for the last one."""
    model = build_model("default")
    first, first_mask = left_padded([120], seed=6, vocab=DEFAULT_BYTES)
    second, second_mask = left_padded([130], seed=7, vocab=DEFAULT_BYTES)  # its first step holds the pages the last one did
    spec = "specache(top_k=2, dense_layers=1)"
    fresh = generate(model, second, second_mask, kvlib.make_cache(model, spec), steps=12)
    policy = kvlib.parse_policy(spec)
    generate(model, first, first_mask, kvlib.make_cache(model, policy), steps=12)
    again = generate(model, second, second_mask, kvlib.make_cache(model, policy), steps=12)
    assert torch.equal(again.sequences, fresh.sequences)
    assert_same_logits(again.logits, fresh.logits)
