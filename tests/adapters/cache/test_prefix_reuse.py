"""Prefix reuse across generate calls: identical outputs, only the suffix computed, pages shared
by reference, lossless and lossy pages kept apart, LRU eviction that frees pages, bad input."""

from __future__ import annotations

import copy
import gc
import sys
import threading

import pytest
import torch

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, build_model, edit_one_weight, left_padded, prompt_vocab


def prompts(vocab: int, shared: int = 70, tails: tuple[int, ...] = (9, 13), seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (1, shared), generator=generator)
    return [torch.cat([system, torch.randint(3, vocab, (1, tail), generator=generator)], 1) for tail in tails]


def tokens_computed(model: torch.nn.Module) -> tuple[list[int], object]:
    """Per forward call, the tokens the model ran on (a hook on the input embeddings)."""
    calls: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    return calls, handle


@pytest.mark.parametrize("family", ["default", "llama", "gpt2"])
def test_reuse_computes_only_the_suffix_and_changes_no_output(family: str) -> None:
    model = build_model(family)
    vocab = prompt_vocab(family)
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    calls, handle = tokens_computed(model)
    first, second = prompts(vocab)
    for prompt, reused in ((first, 0), (second, 64), (second, 80)):  # 16-token pages; never the last token
        reference = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
        calls.clear()
        cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
        assert cache.get_seq_length() == reused
        out = model.generate(prompt, **cache_argument(cache), max_new_tokens=12, do_sample=False, pad_token_id=PAD)
        assert torch.equal(out, reference)
        assert calls[0] == prompt.shape[1] - reused  # the prefill ran on the suffix only
    handle.remove()
    assert store.stats()["hits"] == 4 + 5


def test_pages_are_shared_by_reference_and_released_when_caches_go() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    prompt = prompts(DEFAULT_BYTES, shared=64, tails=(1,))[0]  # 65 tokens: 4 full pages, the 5th computed
    warm = kvlib.make_cache(model, reuse=store, prompt=prompt)
    model.generate(prompt, **cache_argument(warm), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    paged = next(iter(store.stores.values()))
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    caches = [kvlib.make_cache(model, reuse=store, prompt=prompt) for _ in range(8)]
    for cache in caches:
        model.generate(prompt, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    pool = paged.pools[0]
    assert pool.pages_in_use == 4 * heads + 9 * heads  # the prefix once, plus each cache's own last page
    assert bool((pool.refcount[paged.tables[0].pages[caches[0]._rows[0], :, :4]] == 1 + 9).all())  # the index + 9 caches
    del warm, caches, cache
    gc.collect()
    store.collect()  # what the dropped caches held goes back at the store's next use
    assert all(p.pages_in_use == 4 * heads for p in paged.pools)  # only the index's pages remain
    assert store.stats()["unused_entries"] == 4 and len(paged.sequences) == 0
    store.index.clear()
    assert all(p.pages_in_use == 0 for p in paged.pools) and layers == len(paged.pools)


def test_capacity_evicts_least_recently_used_unused_prefixes() -> None:
    model = build_model("default")
    heads, layers, head_dim = model.config.num_key_value_heads, model.config.num_hidden_layers, model.config.head_dim
    page = 16 * (2 * head_dim * 4 + 8)  # keys + values float32 + int64 positions
    store = kvlib.PrefixStore(model, capacity_bytes=4 * layers * heads * page)  # four blocks
    for seed in range(3):  # three prompts of 4 full pages each: 12 blocks through a 4-block cache
        prompt = prompts(DEFAULT_BYTES, shared=64, tails=(1,), seed=seed)[0]
        cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
        model.generate(prompt, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
        cache.reset()
    stats = store.stats()
    assert stats["entries"] == 4 and stats["evictions"] == 8 and stats["bytes"] <= store.index.capacity_bytes
    paged = next(iter(store.stores.values()))
    assert all(p.pages_in_use == 4 * heads for p in paged.pools)
    newest = prompts(DEFAULT_BYTES, shared=64, tails=(1,), seed=2)[0]
    assert kvlib.make_cache(model, reuse=store, prompt=newest).get_seq_length() == 64  # the last prompt survived


def test_lossless_and_lossy_pages_are_never_mixed() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    prompt = prompts(DEFAULT_BYTES, shared=64, tails=(5,))[0]
    exact = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    quantized = kvlib.make_cache(model, "kivi(bits=2)", reuse=store, prompt=prompt)
    lossy = model.generate(prompt, **cache_argument(quantized), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    lossless = kvlib.make_cache(model, reuse=store, prompt=prompt)
    assert lossless.get_seq_length() == 0  # the kivi pages are not for an exact cache
    assert torch.equal(model.generate(prompt, **cache_argument(lossless), max_new_tokens=8, do_sample=False, pad_token_id=PAD), exact)
    again = kvlib.make_cache(model, "kivi(bits=2)", reuse=store, prompt=prompt)
    assert again.get_seq_length() == 64  # the same codec shares them
    # (not token-equal to the first kivi run: there the prompt attended to its own tokens before they
    # were sealed; reused, the suffix attends to the 2-bit pages)
    reused = model.generate(prompt, **cache_argument(again), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert reused.shape == lossy.shape
    other = kvlib.make_cache(model, "kivi(bits=4)", reuse=store, prompt=prompt)
    assert other.get_seq_length() == 0
    salted = kvlib.PrefixStore(model, capacity_bytes=2**24, salt="tenant b")
    assert salted.namespace("", torch.float32, torch.device("cpu"), 16) != store.namespace("", torch.float32, torch.device("cpu"), 16)


def test_a_batch_reuses_the_prefix_common_to_its_rows_and_beams_work() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    first, second = prompts(DEFAULT_BYTES, shared=48, tails=(20, 20))
    batch = torch.cat([first, second])
    warm = kvlib.make_cache(model, reuse=store, prompt=first)
    model.generate(first, **cache_argument(warm), max_new_tokens=1, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model, reuse=store, prompt=batch)
    assert cache.get_seq_length() == 48  # row 0 has 4 cached pages, row 1 shares 3
    reference = model.generate(batch, max_new_tokens=10, do_sample=False, pad_token_id=PAD, num_beams=2)
    beams = kvlib.make_cache(model, reuse=store, prompt=batch.repeat_interleave(2, dim=0))  # the rows beam search runs
    out = model.generate(batch, **cache_argument(beams), max_new_tokens=10, do_sample=False, pad_token_id=PAD, num_beams=2)
    assert torch.equal(out, reference)


def test_padding_disables_reuse_and_keeps_outputs() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    ids, mask = left_padded([40, 33], seed=3, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, reuse=store, prompt=ids, attention_mask=mask)
    assert cache.get_seq_length() == 0
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD))
    assert store.stats()["entries"] == 0


def test_a_forced_hash_collision_reuses_nothing_wrong() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    store.index.hash_function = lambda parent, tokens, namespace: b"one key for every block"
    first, second = prompts(DEFAULT_BYTES, shared=0, tails=(40, 40))  # nothing in common
    cache = kvlib.make_cache(model, reuse=store, prompt=first)
    model.generate(first, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    cache = kvlib.make_cache(model, reuse=store, prompt=second)
    assert cache.get_seq_length() == 0 and store.stats()["collisions"] >= 1
    out = model.generate(second, **cache_argument(cache), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(second, max_new_tokens=8, do_sample=False, pad_token_id=PAD))


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("streaming_llm", {"budget": 16}, "needs every prompt token stored"),
        ("svd", {}, "fits itself to each prompt"),
        (None, {"reuse": "a store"}, "reuse must be a kvlib.PrefixStore"),
    ],
)
def test_bad_reuse_is_refused_before_any_model_work(spec, kwargs, message) -> None:
    model = build_model("default")
    kwargs = {"reuse": kvlib.PrefixStore(model, capacity_bytes=1024), **kwargs}
    with pytest.raises(ValueError, match=message):
        kvlib.make_cache(model, spec, **kwargs)


def test_a_store_of_another_model_and_a_prompt_without_store_are_refused() -> None:
    default, llama = build_model("default"), build_model("llama")
    with pytest.raises(ValueError, match="another model"):
        kvlib.make_cache(llama, reuse=kvlib.PrefixStore(default, capacity_bytes=1024))
    with pytest.raises(ValueError, match="pass reuse="):
        kvlib.make_cache(default, prompt=torch.ones(1, 4, dtype=torch.long))
    cache = kvlib.make_cache(default, reuse=kvlib.PrefixStore(default, capacity_bytes=1024), prompt=torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="empty cache"):
        cache.prime(torch.ones(1, 4, dtype=torch.long))


def test_an_edited_model_never_meets_the_originals_pages() -> None:
    """One value changed in the middle of one tensor (shapes and config unchanged) makes another
    model: refused by the store, as an edited copy or as the original edited in place after the
    store was filled. An unchanged reload of the same weights reuses."""
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    prompt = prompts(DEFAULT_BYTES, shared=64, tails=(6,))[0]
    cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
    model.generate(prompt, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    reloaded = build_model("default")
    cache = kvlib.make_cache(reloaded, reuse=store, prompt=prompt)
    assert cache.get_seq_length() == 64
    out = reloaded.generate(prompt, **cache_argument(cache), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, reloaded.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=PAD))
    edited = copy.deepcopy(reloaded)
    edit_one_weight(edited)
    with pytest.raises(ValueError, match="another model"):
        kvlib.make_cache(edited, reuse=store, prompt=prompt)
    edit_one_weight(model)
    with pytest.raises(ValueError, match="another model"):
        kvlib.make_cache(model, reuse=store, prompt=prompt)


def test_an_unprimed_cache_in_a_prefix_store_gives_its_rows_back() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    prompt = prompts(DEFAULT_BYTES, shared=40, tails=(1,))[0]
    cache = kvlib.make_cache(model, reuse=store)  # no prompt: nothing reused or indexed
    out = model.generate(prompt, **cache_argument(cache), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=PAD))
    paged = next(iter(store.stores.values()))
    assert paged.pools[0].pages_in_use > 0 and store.stats()["entries"] == 0
    del cache
    gc.collect()
    store.collect()
    assert all(p.pages_in_use == 0 for p in paged.pools) and not paged.sequences


def test_the_next_turn_reuses_the_answer_once_it_is_indexed() -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24)
    first = prompts(DEFAULT_BYTES, shared=40, tails=(1,))[0]
    cache = kvlib.make_cache(model, reuse=store, prompt=first)
    answer = model.generate(first, **cache_argument(cache), max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    cache.index_tokens(answer)  # 81 tokens, 80 stored: five full pages
    follow_up = torch.cat([answer, torch.tensor([[7, 8, 9]])], dim=1)
    second = kvlib.make_cache(model, reuse=store, prompt=follow_up)
    assert second.get_seq_length() == 80
    out = model.generate(follow_up, **cache_argument(second), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(follow_up, max_new_tokens=6, do_sample=False, pad_token_id=PAD))
    with pytest.raises(ValueError, match="start with the prompt"):
        second.index_tokens(torch.zeros(1, 90, dtype=torch.long))


def test_coded_and_exact_pages_go_to_disk_each_under_their_own_namespace(tmp_path) -> None:
    model = build_model("default")
    store = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=str(tmp_path))
    prompt = prompts(DEFAULT_BYTES, shared=64, tails=(5,))[0]
    quantized = kvlib.make_cache(model, "kivi(bits=2)", reuse=store, prompt=prompt)
    model.generate(prompt, **cache_argument(quantized), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert store.disk.stats()["writes"] == 4  # the coded cache's four full pages, as their encoded fields
    exact = kvlib.make_cache(model, reuse=store, prompt=prompt)
    model.generate(prompt, **cache_argument(exact), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert store.disk.stats()["writes"] == 8  # the exact cache's own four: lossless never meets lossy pages
    again = kvlib.make_cache(model, "kivi(bits=2)", reuse=store, prompt=prompt)
    assert again.get_seq_length() == 64  # the coded pages are reused from memory


def test_threads_with_their_own_caches_share_one_small_evicting_store() -> None:
    """Four threads, each generating with caches of its own, on one PrefixStore too small for their
    prompts (blocks evicted and indexed while the other thread's forward runs): every output equals
    the model's alone, and nothing raises. Each model call holds the store's lock."""
    model = build_model("llama")
    cases = [prompts(90, shared=48, tails=(5, 21), seed=seed) for seed in range(6)]
    cases = [prompt for pair in cases for prompt in pair]
    reference = [model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=PAD) for prompt in cases]
    page = 16 * 2 * 2 * (8 * 4 * 2 + 8)  # a block's bytes: layers x KV heads x (keys + values float32, positions)
    store = kvlib.PrefixStore(model, capacity_bytes=5 * page)
    failures: list[str] = []

    def serve(order: list[int]) -> None:
        try:
            for _ in range(3):
                for i in order:
                    cache = kvlib.make_cache(model, reuse=store, prompt=cases[i])
                    out = model.generate(cases[i], **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
                    if not torch.equal(out, reference[i]):
                        failures.append(f"prompt {i}: wrong output")
        except Exception as error:  # noqa: BLE001 - every failure of a thread is reported by the test
            failures.append(f"{type(error).__name__}: {error}")

    evens, odds = list(range(0, 12, 2)), list(range(1, 12, 2))
    orders = (list(range(12)), list(range(11, -1, -1)), evens + odds, odds + evens)
    threads = [threading.Thread(target=serve, args=(order,)) for order in orders]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: a race shows in a short run
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    assert store.stats()["evictions"] > 0 and store.stats()["hits"] > 0
    gc.collect()
    store.collect()
    (paged,) = store.stores.values()
    assert len(paged.sequences) == 0  # every cache's rows given back
