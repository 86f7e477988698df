"""``tailorkv`` through generate: with ``top_k`` covering every page the output is the untiered
cache's (the embedded default model, whose layers are found of both kinds), alone (pages on the host) and under a codec (``kivi(bits=2)+tailorkv``: sealed pages coded on every tier);
after the first decode step each layer is identified, a dense layer then reads every page and a
sparse one its ``top_k`` per head; the device holds its page budget and the key summaries; the
Engine refuses it (tiering)."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.test_shadowkv import assert_each_page_in_one_tier, generate, page_mb
from tests.adapters.conftest import DEFAULT_BYTES, assert_same_logits, build_model, left_padded


def test_covering_every_page_equals_the_untiered_cache_with_pages_on_the_host() -> None:
    model = build_model("default")
    ids, mask = left_padded([75, 50], seed=3, vocab=DEFAULT_BYTES)
    reference = generate(model, ids, mask)
    policy = kvlib.parse_policy(f"tailorkv(top_k=8, dense_share=0.5, placement='lru(device_mb={page_mb(model, 2, 2)})')")
    cache = kvlib.make_cache(model, policy)
    out = generate(model, ids, mask, cache)
    assert set(policy.dense.values()) == {True, False}
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    assert all(pool.pages_on_host > 0 for pool in cache.store.pools)
    assert_each_page_in_one_tier(cache)


def test_under_a_2_bit_codec_covering_every_page_equals_the_untiered_coded_cache() -> None:
    model = build_model("default")
    ids, mask = left_padded([90, 70], seed=5, vocab=DEFAULT_BYTES)
    reference = generate(model, ids, mask, kvlib.make_cache(model, "kivi(bits=2)"), steps=16)
    cache = kvlib.make_cache(model, "kivi(bits=2)+tailorkv(top_k=100, placement='lru(device_mb=0.004)')")
    out = generate(model, ids, mask, cache, steps=16)
    assert torch.equal(out.sequences, reference.sequences)
    report = cache.memory_report()
    assert report["by_tier"]["host"] > 0
    coded = kvlib.make_cache(model, "kivi(bits=2)")
    generate(model, ids, mask, coded, steps=16)
    assert report["by_component"]["pages"] == coded.memory_report()["by_component"]["pages"]  # the same coded bytes, tiered


def test_dense_layers_read_every_page_and_sparse_layers_their_top_k() -> None:
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    policy = kvlib.parse_policy(f"tailorkv(top_k=3, dense_share=0.5, placement='lru(device_mb={page_mb(model, 2, 1)})')")
    cache = kvlib.make_cache(model, policy)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
        for step in range(3):
            before = [pool.host_pages_read for pool in cache.store.pools]
            model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 151 + step, dtype=torch.long), **cache_argument(cache))
            read = [pool.host_pages_read - b for pool, b in zip(cache.store.pools, before)]
            assert sorted(policy.dense) == list(range(layers))  # every layer identified at the first step
            for layer, pool in enumerate(cache.store.pools):
                if policy.dense[layer]:  # every page: those off the device copied
                    assert read[layer] == heads * 10 - pool.pages_on_device, (step, layer)
                else:
                    assert heads * 3 - pool.pages_on_device <= read[layer] <= heads * 3, (step, layer)
    assert set(policy.dense.values()) == {True, False}  # this prompt has layers of both kinds
    assert all(pool.pages_on_device == 2 * heads for pool in cache.store.pools)
    report = cache.memory_report()
    page_bytes = 16 * 2 * model.config.head_dim * 4
    device_parts = ("positions", "key_summaries", "tables", "read_cache")
    assert report["by_tier"]["device"] == layers * heads * 2 * page_bytes + sum(report["by_component"][p] for p in device_parts)
    assert report["by_tier"]["host"] == layers * heads * (10 - 2) * page_bytes


def test_a_new_prompt_is_identified_anew() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    policy = kvlib.parse_policy("tailorkv(top_k=3, dense_share=0.5)")
    cache = kvlib.make_cache(model, policy)
    generate(model, ids, mask, cache, steps=2)
    policy.dense[0] = not policy.dense[0]  # as if another prompt had found it otherwise
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(kvlib.make_cache(model, policy)))
    assert policy.dense == {}  # the prompt's calls forgot every layer's kind


def test_the_engine_refuses_it_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^the engine does not apply tiering or reuse policies yet \(tailorkv\(top_k=2\)\)"):
        kvlib.Engine(build_model("llama"), "tailorkv(top_k=2)")
