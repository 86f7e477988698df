"""An exact cache's decode steps attend straight over the pages: no dense mirror, no dense read,
and the same tokens as DynamicCache; a quantized cache's decode steps too (sealed pages decoded
inside the kernel), with the same tokens as its dense-decode path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvlib
from kvlib.registry import available_policies
from kvlib.storage.store.paged_store import PagedStore
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
    out = model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(cache),
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return len(reads), out


def test_decode_steps_read_no_dense_copy_and_equal_dynamic_cache(family) -> None:
    model = build_model(family)
    ids, mask = left_padded([9, 17, 30], seed=5)
    reference = model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(DynamicCache(config=model.config)),
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_logits=True,
    )
    cache = kvlib.make_cache(model)
    dense_reads, out = count_dense_reads(cache, model, ids, mask)
    assert dense_reads == 0  # the prefill attends over its own tensors, decode steps over the pages
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    report = cache.memory_report()
    assert report["by_component"]["read_cache"] == 0
    assert report["peak_workspace_bytes"] == 0


def test_a_later_prompt_chunk_reads_a_transient_copy_and_reports_its_peak() -> None:
    model = build_model("llama")
    ids = torch.randint(3, 90, (2, 50), generator=torch.Generator().manual_seed(3))
    reference = DynamicCache(config=model.config)
    cache = kvlib.make_cache(model)
    with torch.no_grad():
        for chunk in (ids[:, :30], ids[:, 30:]):  # the second chunk (20 tokens) attends over 50
            expected = model(input_ids=chunk, **cache_argument(reference)).logits
            got = model(input_ids=chunk, **cache_argument(cache)).logits
            assert_same_logits(got, expected)
    report = cache.memory_report()
    layer_bytes = 2 * 2 * model.config.num_key_value_heads * 50 * (model.config.hidden_size // model.config.num_attention_heads) * 4
    assert report["peak_workspace_bytes"] >= layer_bytes  # one layer's dense copy at a time
    assert report["by_component"]["read_cache"] == 0


def test_a_mirror_is_kept_only_when_asked_for() -> None:
    model = build_model("default")
    ids, mask = left_padded([20], seed=6)
    for options, mirrored in (({}, False), ({"read_cache": True}, True)):
        cache = kvlib.make_cache(model, **options)
        model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=3, pad_token_id=PAD)
        assert (cache.memory_report()["by_component"]["read_cache"] > 0) == mirrored
    assert not kvlib.make_cache(model, "streaming_llm", budget=8).read_cache
    assert kvlib.make_cache(model, "streaming_llm", budget=8, read_cache=True).read_cache
    assert not kvlib.make_cache(model, "kivi(bits=4)").read_cache


def against_the_dense_path(monkeypatch, model, ids, mask, spec: str, options: dict, **cache_options) -> tuple:
    """``generate`` with ``make_cache(model, spec, **cache_options)`` twice: with a dense read
    mirror (decode steps read a dense copy), then as it is, counting the dense reads of the store
    (on the class: a codec cache starts a new store on reset). Returns ``(reference, out, dense
    cache, cache, reads)``."""
    dense = kvlib.make_cache(model, spec, read_cache=True, **cache_options)
    reference = model.generate(ids, attention_mask=mask, **cache_argument(dense), **options)
    reads = []
    original = PagedStore.read
    monkeypatch.setattr(PagedStore, "read", lambda *args, **kwargs: reads.append(args[1]) or original(*args, **kwargs))
    cache = kvlib.make_cache(model, spec, **cache_options)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), **options)
    return reference, out, dense, cache, reads


@pytest.mark.parametrize("family", ["llama", "default"])
@pytest.mark.parametrize("spec", ["kivi(bits=4)", "kv_bits", "int8", "fp8"])
def test_codec_decode_steps_read_no_dense_copy_and_equal_the_dense_decode(spec: str, family: str, monkeypatch) -> None:
    """20 new tokens after prompts of up to 30: decode steps fill and seal pages (16 tokens)."""
    model = build_model(family)
    ids, mask = left_padded([9, 17, 30], seed=5, vocab=model.config.vocab_size)
    options = {"do_sample": False, "max_new_tokens": 20, "pad_token_id": PAD, "return_dict_in_generate": True, "output_logits": True}
    reference, out, _, cache, reads = against_the_dense_path(monkeypatch, model, ids, mask, spec, options)
    assert reads == []  # the prefill attends over its own tensors, decode steps over the (coded) pages
    assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(out.logits, reference.logits):  # a quantization step of a page sealed
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)  # later may amplify rounding
    report = cache.memory_report()
    assert report["by_component"]["read_cache"] == 0
    assert report["by_component"]["codec_metadata"] > 0  # pages sealed, and read through the kernel


@pytest.mark.parametrize("spec", available_policies()["eviction"])
def test_evicting_decode_steps_attend_over_the_pages_and_keep_what_the_dense_path_keeps(spec: str, monkeypatch) -> None:
    """A budget held while decoding (every step evicts): decode steps attend over the pages, the
    compaction after them reads positions only for policies that score without keys and values
    (``reads_kv`` False), and the tokens and kept positions equal those of the dense-read path."""
    model = build_model("llama")
    ids, mask = left_padded([12, 40], seed=7, vocab=model.config.vocab_size)
    options = {
        "do_sample": False,
        "max_new_tokens": 12,
        "min_new_tokens": 12,
        "pad_token_id": PAD,
        "return_dict_in_generate": True,
        "output_logits": True,
    }
    reference, out, dense, cache, reads = against_the_dense_path(monkeypatch, model, ids, mask, spec, options, budget=16)
    if not cache.evictor.reads_kv:
        assert reads == []
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer), dense.kept_positions(layer)), f"layer {layer}"
    assert cache.memory_report()["by_component"]["read_cache"] == 0


@pytest.mark.parametrize("spec", ["snapkv+kivi(bits=4)", "h2o+kv_bits"])
def test_evicting_quantized_decode_steps_score_from_the_coded_pages(spec: str, monkeypatch) -> None:
    """Eviction over quantized pages: attention and the compaction's attention weights decode the
    sealed pages inside the kernels; no dense read, and the dense-decode path's tokens and kept
    positions."""
    model = build_model("llama")
    ids, mask = left_padded([12, 40], seed=7, vocab=model.config.vocab_size)
    options = {"do_sample": False, "max_new_tokens": 20, "min_new_tokens": 20, "pad_token_id": PAD}
    reference, out, dense, cache, reads = against_the_dense_path(monkeypatch, model, ids, mask, spec, options, budget=24)
    assert reads == []
    assert torch.equal(out, reference)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer), dense.kept_positions(layer)), f"layer {layer}"
    assert cache.memory_report()["by_component"]["codec_metadata"] > 0


def test_prompt_compression_by_a_key_reading_policy_reads_nothing_while_decoding(monkeypatch) -> None:
    """A float budget compacts the prompt only: decode steps attend over the pages and, with no
    compaction due, never read keys or values densely even for a policy that scores with them."""
    model = build_model("llama")
    ids, mask = left_padded([12, 40], seed=7, vocab=model.config.vocab_size)
    options = {"do_sample": False, "max_new_tokens": 8, "min_new_tokens": 8, "pad_token_id": PAD}
    reference, out, dense, cache, reads = against_the_dense_path(monkeypatch, model, ids, mask, "knorm", options, budget=0.5)
    assert cache.evictor.reads_kv and reads == []
    assert torch.equal(out, reference)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer), dense.kept_positions(layer)), f"layer {layer}"
