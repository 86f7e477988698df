"""``quest`` through generate: with ``top_k`` at least the pages held the output is the exact
cache's (tokens and logits, bit for bit, with or without host and disk tiers); a decode step reads only
``top_k`` pages per head; on the embedded default model a small ``top_k`` follows the full cache more closely
than random pages do; what quest does not combine with is refused before any work."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.eval.agreement import agreement_metrics, greedy_reference, teacher_forced_logits
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, assert_same_logits, build_model, left_padded, prompt_vocab


def generate(model, ids, mask, cache=None):
    return model.generate(
        ids,
        attention_mask=mask,
        **cache_argument(cache),
        max_new_tokens=20,
        do_sample=False,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )


@pytest.mark.parametrize("family", ["default", "llama"])
@pytest.mark.parametrize("placement", ["", ", placement='lru(device_mb=0.01)'"])
def test_top_k_covering_every_page_equals_the_exact_cache(family: str, placement: str) -> None:
    model = build_model(family)
    ids, mask = left_padded([75, 50], seed=3, vocab=prompt_vocab(family))
    reference = generate(model, ids, mask)
    cache = kvlib.make_cache(model, f"quest(top_k=8, dense_layers=0{placement})")  # 95 tokens: 6 pages
    out = generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)


def test_quest_reads_chosen_pages_from_every_tier_of_its_placement(tmp_path) -> None:
    model = build_model("default")
    ids, mask = left_padded([75, 50], seed=3, vocab=DEFAULT_BYTES)
    reference = generate(model, ids, mask)
    placement = f"lru(device_mb=0.001, host_mb=0.001, disk={str(tmp_path)!r}, disk_mb=16)"
    cache = kvlib.make_cache(model, f"quest(top_k=8, dense_layers=0, placement={placement!r})")
    out = generate(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    pools = cache.store.pools
    assert all(pool.pages_on_disk > 0 and pool.pages_on_host > 0 for pool in pools)
    assert len(cache.spill.keys()) == sum(pool.pages_on_disk for pool in pools)


def test_a_decode_step_reads_only_top_k_pages_per_head() -> None:
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ids, mask = left_padded([160], seed=4, vocab=DEFAULT_BYTES)  # 11 pages per head after the step
    for spec, per_head in (("quest(top_k=3, dense_layers=2, placement='lru(device_mb=0.001)')", 3), ("lru(device_mb=0.001)", 11)):
        cache = kvlib.make_cache(model, spec)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
            before = [pool.host_pages_read for pool in cache.store.pools]
            model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 161, dtype=torch.long), **cache_argument(cache))
        read = [pool.host_pages_read - b for pool, b in zip(cache.store.pools, before)]
        on_device = [pool.pages_on_device for pool in cache.store.pools]
        sparse_layers = range(2, layers) if spec.startswith("quest") else range(layers)
        for layer in sparse_layers:  # every page but the few on the device is a host page copied, or not
            assert heads * per_head - on_device[layer] <= read[layer] <= heads * per_head, (spec, layer, read)


def test_read_selected_returns_exactly_the_chosen_pages() -> None:
    store = kvlib.PagedStore(kvlib.StoreConfig(1, 2, 3, page_size=4, key_summaries=True, device_pages=2))
    seq = store.new_sequence()
    keys = torch.randn(1, 2, 14, 3)
    store.append(0, [seq], keys, -keys)
    chosen = torch.tensor([[[0, 3], [2, -1]]])
    read = store.read_selected(0, [seq], chosen)
    assert read.keys.shape == (1, 2, 6, 3)  # 8 slots, the last 2 held by no head
    assert torch.equal(read.keys[0, 0, :4], keys[0, 0, 0:4]) and torch.equal(read.keys[0, 0, 4:6], keys[0, 0, 12:14])
    assert torch.equal(read.keys[0, 1, :4], keys[0, 1, 8:12]) and torch.equal(read.values[0, 1, :4], -keys[0, 1, 8:12])
    assert read.valid[0].tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert read.positions[0, 0].tolist() == [0, 1, 2, 3, 12, 13] and read.positions[0, 1, 4:].tolist() == [-1, -1]
    key_min, key_max, used = store.key_bounds(0, [seq])
    assert used.tolist() == [[4, 4]] and torch.equal(key_min[0, 1, 3], keys[0, 1, 12:14].amin(0))
    with pytest.raises(ValueError, match="pages each head holds"):
        store.read_selected(0, [seq], torch.tensor([[[4], [0]]]))


@pytest.mark.slow  # a benchmark's quick run or a quality comparison: run with -m slow (CI's 15 minutes)
@pytest.mark.slow  # about 100 s on a loaded 2-core machine
def test_small_top_k_beats_random_pages_on_the_default_model() -> None:
    model = build_model("default")
    prompt = torch.tensor([[model.config.bos_token_id]])
    tokens, logits = greedy_reference(model, kvlib.make_cache(model), prompt, 320)  # the model's own text, 20 pages
    prefix, fed, reference = torch.cat([prompt, tokens[:, :31]], 1), tokens[:, 31:], logits[:, 31:]
    kl = {}
    for spec in ("quest(top_k=3)", "random_pages(top_k=3)"):
        forced = teacher_forced_logits(model, kvlib.make_cache(model, spec), prefix, fed)
        kl[spec] = agreement_metrics(fed, reference, forced)["kl"]
    assert kl["quest(top_k=3)"] < 0.5 * kl["random_pages(top_k=3)"], kl


def test_what_quest_does_not_combine_with_is_refused() -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="does not combine with eviction"):
        kvlib.make_cache(model, "snapkv+quest", budget=32)
    with pytest.raises(ValueError, match="cross-layer codec"):
        kvlib.make_cache(model, "minicache(start=0.0)+quest")
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        kvlib.make_cache(model, "quest(top_k=0)")
    with pytest.raises(ValueError, match="placement must be a device/host placement"):
        kvlib.make_cache(model, "quest(placement='quest')")
    with pytest.raises(ValueError, match="prefix reuse"):
        kvlib.make_cache(model, "quest", reuse=kvlib.PrefixStore(model, capacity_bytes=2**20))


def test_sparse_steps_attend_over_the_chosen_pages_in_place_with_the_tokens_of_a_dense_read(monkeypatch) -> None:
    """Decode steps read nothing densely (only the prefill and the dense layers' steps do), and
    give the tokens and logits the sparse dense read gives (the path taken where pages cannot be
    read in place), with a top_k that leaves pages out and with a host tier."""
    model = build_model("default")
    ids, mask = left_padded([75, 50], seed=3, vocab=DEFAULT_BYTES)
    for spec in ("quest(top_k=2, dense_layers=1)", "quest(top_k=2, dense_layers=1, placement='lru(device_mb=0.01)')"):
        cache = kvlib.make_cache(model, spec)
        reads = {"read": 0, "read_selected": 0}
        with torch.inference_mode():
            model(input_ids=ids[:, :1], attention_mask=mask[:, :1], **cache_argument(cache))  # builds the store
        cache.reset()
        for name in reads:
            original = getattr(cache.store, name)

            def counted(*args, name=name, original=original, **kwargs):
                reads[name] += 1
                return original(*args, **kwargs)

            setattr(cache.store, name, counted)
        out = generate(model, ids, mask, cache)
        assert reads == {"read": 0, "read_selected": 0}, reads  # the prefill attends over its own tensors
        with monkeypatch.context() as patch:
            patch.setattr(KVCacheLayer, "chosen_pages", lambda self, chosen: None)
            dense = generate(model, ids, mask, kvlib.make_cache(model, spec))
        assert torch.equal(out.sequences, dense.sequences)
        assert_same_logits(out.logits, dense.logits)
