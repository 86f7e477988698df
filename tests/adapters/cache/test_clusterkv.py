"""``clusterkv`` through generate: after the prompt each sparse layer's tokens lie cluster by
cluster; reading every page, the output is the untiered full cache's (tiny random Llama, GPT-2,
the embedded default model, SmolLM2) with pages on the host; the device holds exactly its page budget plus the
key summaries, the host the rest; a decode step reads ``top_k`` pages per head; the Engine refuses
it (tiering), as it does quest."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.test_shadowkv import assert_each_page_in_one_tier, generate
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded, prompt_vocab


def head_dim(model) -> int:
    return model.config.hidden_size // model.config.num_attention_heads


def lru_mb(model, pages_per_head: int, rows: int) -> float:
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return pages_per_head * heads * rows * config.num_hidden_layers * 16 * 2 * head_dim(model) * 4 / 2**20


@pytest.mark.parametrize("family", ["llama", "gpt2", "default"])
def test_reading_every_page_equals_the_full_cache_with_pages_on_the_host(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([75, 50], seed=3, vocab=prompt_vocab(family))
    reference = generate(model, ids, mask)
    spec = f"clusterkv(top_k=8, dense_layers=0, cluster_tokens=8, placement='lru(device_mb={lru_mb(model, 2, 2)})')"
    cache = kvlib.make_cache(model, spec)
    out = generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert all(pool.pages_on_host > 0 for pool in cache.store.pools)
    assert_each_page_in_one_tier(cache)
    stored = cache.store.stored_positions(0, cache.rows)
    prompt = stored[..., : ids.shape[1]]
    assert not torch.equal(prompt, prompt.sort(-1).values)  # arranged by cluster, not by position


def test_a_chunked_prefill_arranges_after_every_chunk_and_reading_every_page_equals_the_full_cache() -> None:
    model = build_model("llama")
    ids, mask = left_padded([75, 50], seed=3)
    options = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True
    )
    reference = model.generate(ids, **options, prefill_chunk_size=16)
    cache = kvlib.make_cache(model, "clusterkv(top_k=8, dense_layers=0, cluster_tokens=8)")
    out = model.generate(ids, **cache_argument(cache), **options, prefill_chunk_size=16)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    prompt = cache.store.stored_positions(1, cache.rows)[..., : ids.shape[1]]
    assert not torch.equal(prompt, prompt.sort(-1).values)


def test_clusters_fill_consecutive_slots_after_the_prompt() -> None:
    model = build_model("default")
    ids, mask = left_padded([96], seed=5, vocab=DEFAULT_BYTES)
    policy = kvlib.parse_policy("clusterkv(top_k=2, dense_layers=1, cluster_tokens=16)")
    cache = kvlib.make_cache(model, policy)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
    dense = cache.store.stored_positions(0, cache.rows)
    assert torch.equal(dense[0, :, :96], torch.arange(96).expand(dense.shape[1], 96))  # a dense layer is not arranged
    for layer in range(1, cache.shape.num_layers):
        read = cache.store.read(layer, cache.rows)
        order = read.positions[0]
        ids_in_slots = policy.cluster_ids(read.keys, read.positions, read.valid)[0]
        for head in range(order.shape[0]):
            clusters = ids_in_slots[head].tolist()
            runs = [c for i, c in enumerate(clusters) if i == 0 or c != clusters[i - 1]]
            assert len(runs) == len(set(runs))  # each cluster's tokens are consecutive
            assert sorted(order[head].tolist()) == list(range(96))


def test_the_device_holds_its_page_budget_and_the_host_the_rest() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    budget = 3
    cache = kvlib.make_cache(model, f"clusterkv(top_k=3, placement='lru(device_mb={lru_mb(model, budget, 1)})')")
    generate(model, ids, mask, cache, steps=12)  # 161 tokens: 11 pages per head
    report = cache.memory_report()
    page_bytes = 16 * 2 * head_dim(model) * 4  # 16 tokens' float32 keys and values
    layers, heads, pages = model.config.num_hidden_layers, model.config.num_key_value_heads, 11
    assert report["by_component"]["pages"] == layers * heads * pages * page_bytes
    assert report["by_tier"]["host"] == layers * heads * (pages - budget) * page_bytes
    device_parts = ("positions", "key_summaries", "tables", "read_cache")
    assert report["by_tier"]["device"] == layers * heads * budget * page_bytes + sum(report["by_component"][p] for p in device_parts)
    assert all(pool.pages_on_device == heads * budget for pool in cache.store.pools)
    assert_each_page_in_one_tier(cache)


def test_a_decode_step_reads_top_k_pages_per_head() -> None:
    model = build_model("default")
    heads = model.config.num_key_value_heads
    ids, mask = left_padded([160], seed=4, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, "clusterkv(top_k=4, dense_layers=2, placement='lru(device_mb=1e-9)')")  # one device page
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
        before = [pool.host_pages_read for pool in cache.store.pools]
        model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 161, dtype=torch.long), **cache_argument(cache))
    read = [pool.host_pages_read - b for pool, b in zip(cache.store.pools, before)]
    assert read[:2] == [heads * 11 - 1] * 2  # dense layers: every page but the one on the device
    assert all(heads * 4 - 1 <= r <= heads * 4 for r in read[2:]), read  # top_k pages per head


@pytest.mark.slow  # the real model (about a minute here): the default-model tests above cover it in CI
def test_smollm2_short_prompt_reading_every_page_equals_the_full_cache(smollm2) -> None:
    loaded = smollm2
    model = loaded.model
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    ids = torch.tensor([loaded.tokenizer.encode(text, bos=True)])
    mask = torch.ones_like(ids)
    reference = generate(model, ids, mask, steps=16)
    cache = kvlib.make_cache(model, "clusterkv(top_k=4, dense_layers=0, cluster_tokens=8, placement='lru(device_mb=0.2)')")
    out = generate(model, ids, mask, cache, steps=16)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert sum(pool.pages_on_host for pool in cache.store.pools) > 0
    assert_each_page_in_one_tier(cache)


def test_the_engine_refuses_tiering() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="does not apply tiering"):
        kvlib.Engine(model, spec="clusterkv")
