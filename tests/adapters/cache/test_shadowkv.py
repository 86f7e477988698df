"""``shadowkv`` through generate: when its window, outliers and pages cover every page the output is
the untiered cache's (tiny random Llama, the embedded default model, SmolLM2), with every page but the window and
the outliers on the host; the device holds exactly its page budget plus the key summaries, the host
the rest, each page in exactly one tier; a decode step reads ``window + outliers + pages`` pages
per head; what shadowkv does not combine with is refused."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, assert_same_logits, build_model, left_padded, prompt_vocab


def generate(model, ids, mask, cache=None, steps: int = 20):
    return model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(cache),
        max_new_tokens=steps,
        do_sample=False,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )


def page_mb(model, pages_per_head: int, rows: int) -> float:
    """MiB of ``pages_per_head`` whole pages (16 tokens) of every KV head, row and layer."""
    config = model.config
    heads = config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    return pages_per_head * heads * rows * config.num_hidden_layers * 16 * 2 * head_dim * 4 / 2**20


def assert_each_page_in_one_tier(cache) -> None:
    for pool in cache.store.pools:
        in_use = pool.refcount > 0
        places = (pool.device_row >= 0).long() + (pool.host_row >= 0).long() + pool.on_disk.long()
        assert bool((places[in_use] == 1).all()) and bool((places[~in_use] == 0).all())


def assert_covering_equals_the_untiered_cache(family: str, spec: str) -> None:
    """A two-row run of ``family`` (left-padded prompts of 75 and 50 tokens) with ``spec`` (a tiering
    policy whose reads cover every page, ``{mb}`` standing for two pages per head and row on the
    device) gives the untiered cache's tokens and logits, with pages on the host, each in one tier."""
    model = build_model(family)
    ids, mask = left_padded([75, 50], seed=3, vocab=prompt_vocab(family))
    reference = generate(model, ids, mask)
    cache = kvlib.make_cache(model, spec.format(mb=page_mb(model, 2, 2)))
    out = generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    assert all(pool.pages_on_host > 0 for pool in cache.store.pools)
    assert_each_page_in_one_tier(cache)


def assert_budget_on_the_device_the_rest_on_the_host(cache, model, budget: int, pages: int) -> None:
    """For ``cache`` of a one-row run on ``model`` (float32) that stores ``pages`` whole pages per KV
    head: the device holds ``budget`` pages per head, with the positions, key summaries (a minimum
    and a maximum key per page), block tables and read mirror; the host the rest, none on disk;
    each page in one tier."""
    report = cache.memory_report()
    layers, heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    page_bytes = 16 * 2 * head_dim * 4  # 16 tokens' float32 keys and values
    assert report["by_component"]["key_summaries"] == layers * heads * pages * 2 * head_dim * 4
    assert report["by_tier"]["host"] == layers * heads * (pages - budget) * page_bytes
    assert report["by_component"]["pages"] == report["by_tier"]["host"] + layers * heads * budget * page_bytes
    device_parts = ("positions", "key_summaries", "tables", "read_cache")
    assert report["by_tier"]["device"] == layers * heads * budget * page_bytes + sum(report["by_component"][p] for p in device_parts)
    assert report["by_tier"]["disk"] == 0
    assert all(pool.pages_on_device == heads * budget for pool in cache.store.pools)
    assert_each_page_in_one_tier(cache)


@pytest.mark.parametrize("family", ["llama", "default"])
def test_covering_every_page_equals_the_untiered_cache_with_the_rest_on_the_host(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([75, 50], seed=3, vocab=prompt_vocab(family))  # 95 tokens after the run: 6 pages
    reference = generate(model, ids, mask)
    spec = f"shadowkv(pages=2, window=2, outliers=2, dense_layers=0, device_mb={page_mb(model, 3, 2)})"
    cache = kvlib.make_cache(model, spec)
    out = generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    assert all(pool.pages_on_host > 0 for pool in cache.store.pools)
    assert_each_page_in_one_tier(cache)


def test_the_device_holds_its_page_budget_and_the_key_summaries_the_host_the_rest() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    budget = 3  # pages per head on the device: a window of 2 and 1 outlier
    cache = kvlib.make_cache(model, f"shadowkv(pages=2, window=2, outliers=1, device_mb={page_mb(model, budget, 1)})")
    generate(model, ids, mask, cache, steps=12)  # 161 tokens: 11 pages per head
    assert_budget_on_the_device_the_rest_on_the_host(cache, model, budget, pages=11)


def test_the_device_keeps_the_outliers_and_the_sliding_window() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, f"shadowkv(pages=1, window=2, outliers=1, device_mb={page_mb(model, 3, 1)})")
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))  # 10 pages per head, the last holding 6 tokens
        outliers = {layer: set(outlier_ids(cache, layer)) for layer in range(model.config.num_hidden_layers)}
        feed = torch.ones(1, 1, dtype=torch.long)
        for step in range(11):  # 161 tokens: a new page
            model(input_ids=feed * 7, attention_mask=torch.ones(1, 151 + step, dtype=torch.long), **cache_argument(cache))
    store = cache.store
    for layer, pool in enumerate(store.pools):
        table = store.tables[layer].pages[cache.rows[0]]  # [heads, pages]
        newest = set(table[:, 9:11].flatten().tolist())
        on_device = set((pool.device_row >= 0).nonzero().squeeze(-1).tolist())
        assert on_device == newest | outliers[layer], layer


def outlier_ids(cache, layer: int) -> list[int]:
    """Page ids on the device right after prefill that are not among each head's 2 newest pages."""
    pool, table = cache.store.pools[layer], cache.store.tables[layer].pages[cache.rows[0]]
    newest = set(table[:, 8:10].flatten().tolist())
    return [page for page in (pool.device_row >= 0).nonzero().squeeze(-1).tolist() if page not in newest]


def test_a_decode_step_reads_window_outliers_and_pages_per_head() -> None:
    model = build_model("default")
    heads = model.config.num_key_value_heads
    ids, mask = left_padded([160], seed=4, vocab=DEFAULT_BYTES)  # 11 pages per head after the step
    cache = kvlib.make_cache(model, "shadowkv(pages=2, window=1, outliers=1, dense_layers=2, device_mb=1e-9)")  # one device page
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
        before = [pool.host_pages_read for pool in cache.store.pools]
        model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 161, dtype=torch.long), **cache_argument(cache))
    read = [pool.host_pages_read - b for pool, b in zip(cache.store.pools, before)]
    assert read[:2] == [heads * 11 - 1] * 2  # dense layers: every page but the one on the device
    assert all(heads * 4 - 1 <= r <= heads * 4 for r in read[2:]), read  # window + outlier + 2 pages per head


@pytest.mark.slow  # the real model (about a minute here): the default-model tests above cover it in CI
def test_smollm2_short_prompt_equals_the_untiered_cache(smollm2) -> None:
    loaded = smollm2
    model = loaded.model
    ids = torch.tensor(
        [loaded.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is", bos=True)]
    )
    mask = torch.ones_like(ids)
    reference = generate(model, ids, mask, steps=24)
    cache = kvlib.make_cache(model, "shadowkv(pages=1, window=1, outliers=1, dense_layers=0, device_mb=0.05)")
    out = generate(model, ids, mask, cache, steps=24)  # under 48 tokens: 3 pages per head
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    assert sum(pool.pages_on_host for pool in cache.store.pools) > 0


def test_eviction_with_shadowkv_is_refused() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="does not combine with eviction"):
        kvlib.make_cache(model, "snapkv+shadowkv", budget=32)


def test_shadowkv_over_coded_pages_covering_every_page_equals_the_untiered_codec() -> None:
    """A codec's sealed pages go to the host encoded (as with quest); choosing every page, the
    output is the untiered coded cache's."""
    model = build_model("llama")
    ids, mask = left_padded([90, 70], seed=5)
    reference = generate(model, ids, mask, kvlib.make_cache(model, "kivi(bits=4)"), steps=16)
    cache = kvlib.make_cache(model, "kivi(bits=4)+shadowkv(pages=100, window=1, outliers=1, dense_layers=0, device_mb=0.004)")
    out = generate(model, ids, mask, cache, steps=16)
    assert torch.equal(out.sequences, reference.sequences)
    assert sum(pool.pages_on_host for pool in cache.store.pools) > 0
