"""Tiering through generate: pages spread over device and host give exactly the untiered output,
the device budget holds, and the memory report splits bytes by tier."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.storage.pools.formats.tiered_format import TieredPages
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded, prompt_vocab


@pytest.mark.parametrize("family", ["default", "llama", "gpt2"])
@pytest.mark.parametrize("device_mb", [0.01, 0.05])
def test_tiered_generate_equals_the_untiered_cache(family: str, device_mb: float) -> None:
    model = build_model(family)
    ids, mask = left_padded([90, 70], seed=3, vocab=prompt_vocab(family))
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model, f"lru(device_mb={device_mb})")
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, reference)
    pools = cache.store.pools
    assert all(isinstance(pool.format, TieredPages) and pool.pages_on_device <= pool.device_pages for pool in pools)
    assert sum(pool.pages_on_host for pool in pools) > 0 and sum(pool.moves_to_host for pool in pools) > 0
    report = cache.memory_report()
    assert report["by_tier"]["host"] == sum(pool.pages_on_host * pool.kv_page_bytes for pool in pools)
    assert report["by_tier"]["device"] + report["by_tier"]["host"] == report["total_bytes"]


def test_beams_and_sampling_are_unchanged_by_tiering() -> None:
    model = build_model("default")
    ids, mask = left_padded([50, 41], seed=4, vocab=DEFAULT_BYTES)
    beams = model.generate(ids, attention_mask=mask, num_beams=3, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    tiered = kvlib.make_cache(model, "lru(device_mb=0.02)")
    assert torch.equal(
        model.generate(
            ids, attention_mask=mask, num_beams=3, max_new_tokens=12, do_sample=False, pad_token_id=PAD, **cache_argument(tiered)
        ),
        beams,
    )
    torch.manual_seed(5)
    sampled = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, pad_token_id=PAD)
    torch.manual_seed(5)
    again = model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        max_new_tokens=12,
        pad_token_id=PAD,
        **cache_argument(kvlib.make_cache(model, "lru(device_mb=0.02)")),
    )
    assert torch.equal(sampled, again)


def test_tiering_composes_with_eviction_and_refuses_cross_layer_codecs() -> None:
    model = build_model("default")
    ids, mask = left_padded([60], seed=5, vocab=DEFAULT_BYTES)
    reference_cache = kvlib.make_cache(model, "snapkv", budget=24)
    reference = model.generate(
        ids, attention_mask=mask, **cache_argument(reference_cache), max_new_tokens=12, do_sample=False, pad_token_id=PAD
    )
    cache = kvlib.make_cache(model, "snapkv+lru(device_mb=0.005)", budget=24)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="cross-layer codec"):
        kvlib.make_cache(model, "minicache(start=0.0)+lru")
    with pytest.raises(ValueError, match="device_mb must be > 0"):
        kvlib.make_cache(model, "lru(device_mb=0)")


def test_a_full_host_tier_is_a_clear_error() -> None:
    model = build_model("default")
    ids, mask = left_padded([90], seed=6, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, "lru(device_mb=0.01, host_mb=0.01)")
    with pytest.raises(kvlib.PoolExhaustedError, match="host tier full"):
        model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=4, do_sample=False, pad_token_id=PAD)


def test_tiered_decode_steps_read_no_dense_copy_and_stage_only_off_device_pages() -> None:
    """An exact tiered cache's decode steps attend over the pages in place, with the untiered
    output: no dense read of a layer (only the prefill's); the off-device pages staged for a
    step count in the peak workspace."""
    model = build_model("default")
    ids, mask = left_padded([90, 70], seed=3, vocab=DEFAULT_BYTES)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model, "lru(device_mb=0.01)")
    with torch.inference_mode():
        model(input_ids=ids[:, :1], attention_mask=mask[:, :1], **cache_argument(cache))  # builds the store
    cache.reset()
    reads = []
    original = cache.store.read
    cache.store.read = lambda *args, **kwargs: reads.append(args) or original(*args, **kwargs)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, reference)
    assert len(reads) == 0  # the prefill attends over its own tensors, decode steps over the pages
    pools = cache.store.pools
    assert all(pool.pages_read > 0 for pool in pools)
    assert cache.memory_report()["peak_workspace_bytes"] >= max(pool.staged_bytes for pool in pools) > 0
