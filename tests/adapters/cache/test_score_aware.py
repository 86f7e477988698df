"""``score_aware`` placement through generate: lossless (the untiered cache's output), and after a
run the device holds exactly the pages its scorer rates highest (each page scored by its best
stored token); bad parameters are refused naming what is valid."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.eviction.knorm import KNorm
from kvlib.policy import LayerView
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, left_padded, prompt_vocab


@pytest.mark.parametrize("family", ["default", "llama"])
def test_score_aware_generate_equals_the_untiered_cache(family: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([90, 70], seed=3, vocab=prompt_vocab(family))
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model, "score_aware(device_mb=0.01, refresh=4)")
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, reference)
    assert sum(pool.moves_to_host for pool in cache.store.pools) > 0


def test_the_device_holds_the_best_scored_pages() -> None:
    model = build_model("default")
    ids, mask = left_padded([150, 120], seed=5, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, "score_aware(device_mb=0.02, refresh=1)")  # re-ranked at every step
    model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    padding = (mask == 0).sum(-1).view(-1, 1, 1)
    for layer, (pool, table) in enumerate(zip(cache.store.pools, cache.store.tables)):
        read = cache.store._gather(layer, torch.tensor(cache._rows), int(table.lengths[cache._rows].max()))
        real = read.valid & (read.positions >= padding)
        scores = KNorm().score(LayerView(layer, 5, read.keys, read.values, read.positions - padding, real))
        scores = scores.masked_fill(~real, float("-inf"))
        pages = table.pages[cache._rows]
        expected = torch.full((pool.capacity,), float("-inf"))
        for (b, h, j), page in zip((pages >= 0).nonzero().tolist(), pages[pages >= 0].tolist()):
            expected[page] = max(expected[page], scores[b, h, j * 16 : (j + 1) * 16].max())
        in_use = (pool.refcount > 0).nonzero().squeeze(-1)
        assert pool.pages_on_device == pool.device_pages < in_use.numel()
        assert torch.equal(pool.page_score[in_use], expected[in_use])
        on_device = pool.device_row[in_use] >= 0
        assert expected[in_use][on_device].min() >= expected[in_use][~on_device].max(), f"layer {layer}"


def test_bad_score_aware_parameters_are_refused() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="use knorm, keydiff, streaming_llm or random"):
        kvlib.make_cache(model, "score_aware(scorer='snapkv')")
    with pytest.raises(ValueError, match="refresh must be >= 1"):
        kvlib.make_cache(model, "score_aware(refresh=0)")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        kvlib.make_cache(model, "score_aware(scorer='nope')")
