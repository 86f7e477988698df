"""Codecs through every tier: a quantized cache whose sealed pages move between device, host and
disk (encoded) gives exactly the untiered quantized cache's output, with ``lru``, ``score_aware``
and ``quest``, on a tiny random Llama and on SmolLM2; the memory report shows encoded bytes on
the host and disk."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.storage.pools.formats.tiered_coded_format import TieredCodedPages
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model, left_padded


def generate(model, spec: str, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, kvlib.KVCache]:
    """Greedy ``generate`` with a cache of ``spec``: the tokens and the cache."""
    cache = kvlib.make_cache(model, spec)
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
    return out, cache


def placements(directory) -> list[str]:
    """Tierings that move pages: lru to the host, lru to the host and on to disk, score_aware,
    and quest choosing every page over lru (lossless)."""
    return [
        "lru(device_mb=0.004)",
        f"lru(device_mb=0.003, host_mb=0.002, disk={str(directory)!r})",
        "score_aware(device_mb=0.004)",
        "quest(top_k=1000, dense_layers=0, placement='lru(device_mb=0.004)')",
    ]


@pytest.mark.parametrize("codec", ["kivi(bits=4)", "int8", "fp8", "gear"])
def test_tiered_coded_generate_equals_the_untiered_coded_cache(codec: str, tmp_path) -> None:
    model = build_model("llama")
    ids, mask = left_padded([90, 70], seed=3)
    reference, _ = generate(model, codec, ids, mask, 20)
    for tiering in placements(tmp_path):
        out, cache = generate(model, f"{codec}+{tiering}", ids, mask, 20)
        assert torch.equal(out, reference), tiering
        pools = cache.store.pools
        assert all(isinstance(pool.format, TieredCodedPages) and pool.tiers.pages_on_device <= pool.device_pages for pool in pools)
        report = cache.memory_report()
        host = sum(pool.pages_on_host for pool in pools) * pools[0].codec.page_bytes()
        assert report["by_tier"]["host"] == host > 0, tiering  # encoded bytes: the codec's, not the compute dtype's
        if "disk" in tiering:
            assert report["by_tier"]["disk"] == sum(pool.pages_on_disk for pool in pools) * pools[0].codec.page_bytes() > 0


def test_quest_with_a_codec_summarizes_the_raw_keys_and_attends_over_chosen_pages() -> None:
    """Quest's key bounds come from the keys as written (before quantization); a small top_k
    reads only the chosen pages, through the tiers."""
    model = build_model("llama")
    ids, mask = left_padded([90], seed=4)
    cache = kvlib.make_cache(model, "kivi(bits=2)+quest(top_k=2, dense_layers=0, placement='lru(device_mb=0.001)')")
    out = model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert out.shape[1] == ids.shape[1] + 4
    store = cache.store
    pool = store.pools[0]
    key_min, _, used = store.key_bounds(0, cache.rows)
    pages = store.tables[0].pages[cache.rows[0], 0, : int(used[0, 0]) - 1]  # the sealed pages of head 0
    assert bool(pool.sealed[pages].all()) and pool.pages_on_host > 0
    decoded, _ = pool.read_pages(pages)
    assert not torch.equal(key_min[0, 0, : pages.numel()], decoded.amin(1))  # 2-bit keys move the bounds: these are the raw keys'


@pytest.mark.slow  # the real model (about a minute here): the default-model tests above cover tiered coded pools in CI
def test_smollm2_tiered_kivi_equals_the_untiered_kivi_cache(smollm2, tmp_path) -> None:
    """SmolLM2 (30 layers, 3 KV heads), a ~300-token prompt: kivi(bits=4) with lru (host, then
    disk), score_aware and quest over lru gives the untiered kivi cache's tokens, pages having
    moved to the host and to disk."""
    model = smollm2.model
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))
    ids = torch.tensor([smollm2.tokenizer.tokenizer.encode(text)])
    assert 250 <= ids.shape[1] <= 400
    mask = torch.ones_like(ids)
    reference, _ = generate(model, "kivi(bits=4)", ids, mask, 16)
    specs = [
        "kivi(bits=4)+lru(device_mb=0.3)",
        f"kivi(bits=4)+lru(device_mb=0.2, host_mb=0.2, disk={str(tmp_path)!r})",
        "kivi(bits=4)+score_aware(device_mb=0.3)",
        "kivi(bits=4)+quest(top_k=1000, placement='lru(device_mb=0.3)')",
    ]
    for spec in specs:
        out, cache = generate(model, spec, ids, mask, 16)
        assert torch.equal(out, reference), spec
        tiers = cache.memory_report()["by_tier"]
        assert tiers["host"] > 0, spec
        if "disk" in spec:
            assert tiers["disk"] > 0, spec


@pytest.mark.parametrize("codec", ["kivi(bits=4)", "fp8"])
def test_tiered_coded_prefix_blocks_reach_disk_records_and_come_back(codec: str, tmp_path) -> None:
    """A tiered coded cache with prefix reuse writes its prompt blocks' encoded fields (read from
    whichever tier holds them) to the disk tier; another prefix store on the same directory
    restores them and the output is the untiered coded cache's."""
    from kvlib.storage.tiers.disk_tier import DiskTier

    model = build_model("llama")
    prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))
    spec = f"{codec}+lru(device_mb=0.002)"
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    plain = model.generate(prompt, **cache_argument(kvlib.make_cache(model, codec)), **kwargs)
    disk = DiskTier(tmp_path / "prefixes", capacity_bytes=2**26)
    for reused_expected, store in ((0, kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)), (64, None)):
        store = store or kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)  # a second store: only the disk
        cache = kvlib.make_cache(model, spec, reuse=store, prompt=prompt)
        assert cache.get_seq_length() == reused_expected
        assert torch.equal(model.generate(prompt, **cache_argument(cache), **kwargs), plain)
        pools = next(iter(store.stores.values())).pools
        assert all(isinstance(pool.format, TieredCodedPages) for pool in pools)
    assert disk.stats()["writes"] == 4 and disk.stats()["reads"] == 4 and disk.stats()["corrupt"] == 0
