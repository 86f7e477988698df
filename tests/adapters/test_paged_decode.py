"""An exact cache's decode steps attend straight over the pages: no dense mirror, no dense read,
and the same tokens as DynamicCache; a quantized cache's decode steps too (sealed pages decoded
inside the kernel), with the same tokens as its dense-decode path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.paged_store import PagedStore
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, assert_same_logits, build_model, left_padded


def count_dense_reads(cache: kvlib.KVCache, model, ids, mask, new_tokens: int = 6) -> tuple[int, object]:
    """Dense reads of the store during a greedy generate of ``new_tokens`` tokens (the prefill's included)."""
    reads = []
    with torch.no_grad():
        model(input_ids=ids[:, :1], attention_mask=mask[:, :1], **cache_argument(cache))  # builds the store
    original = cache.store.read
    cache.store.read = lambda *args, **kwargs: reads.append(args) or original(*args, **kwargs)
    cache.reset()
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=new_tokens,
                         pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
    return len(reads), out


def test_decode_steps_read_no_dense_copy_and_equal_dynamic_cache(family) -> None:
    model = build_model(family)
    ids, mask = left_padded([9, 17, 30], seed=5)
    reference = model.generate(ids, attention_mask=mask, **cache_argument(DynamicCache(config=model.config)), do_sample=False,
                               max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
    cache = kvlib.make_cache(model)
    dense_reads, out = count_dense_reads(cache, model, ids, mask)
    assert dense_reads == model.config.num_hidden_layers  # the prefill's only: one per layer
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    report = cache.memory_report()
    assert report["by_component"]["read_cache"] == 0
    assert report["peak_workspace_bytes"] > 0  # the prefill's transient dense copy, not held


def test_a_mirror_is_kept_only_when_asked_for_or_under_eviction() -> None:
    model = build_model("stories")
    ids, mask = left_padded([20], seed=6)
    for options, mirrored in (({}, False), ({"read_cache": True}, True)):
        cache = kvlib.make_cache(model, **options)
        model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=3, pad_token_id=PAD)
        assert (cache.memory_report()["by_component"]["read_cache"] > 0) == mirrored
    assert kvlib.make_cache(model, "streaming_llm", budget=8).read_cache
    assert not kvlib.make_cache(model, "kivi(bits=4)").read_cache


@pytest.mark.parametrize("family", ["llama", "stories"])
@pytest.mark.parametrize("spec", ["kivi(bits=4)", "kv_bits", "int8", "fp8"])
def test_codec_decode_steps_read_no_dense_copy_and_equal_the_dense_decode(spec: str, family: str, monkeypatch) -> None:
    """20 new tokens after prompts of up to 30: decode steps fill and seal pages (16 tokens).
    Dense reads are counted on the class: a codec cache starts a new store on reset."""
    model = build_model(family)
    ids, mask = left_padded([9, 17, 30], seed=5, vocab=model.config.vocab_size)
    options = {"do_sample": False, "max_new_tokens": 20, "pad_token_id": PAD, "return_dict_in_generate": True, "output_logits": True}
    dense = kvlib.make_cache(model, spec, read_cache=True)  # decode steps read a mirror of the decoded pages
    reference = model.generate(ids, attention_mask=mask, **cache_argument(dense), **options)
    reads = []
    original = PagedStore.read
    monkeypatch.setattr(PagedStore, "read", lambda *args, **kwargs: reads.append(args[1]) or original(*args, **kwargs))
    cache = kvlib.make_cache(model, spec)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), **options)
    assert sorted(reads) == list(range(model.config.num_hidden_layers))  # the prefill's only: one per layer
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    report = cache.memory_report()
    assert report["by_component"]["read_cache"] == 0
    assert report["by_component"]["codec_metadata"] > 0  # pages sealed, and read through the kernel
