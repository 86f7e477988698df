"""``leoam`` through generate: reading every chunk (no deserts, ``top_k`` covering every page) the
output is the untiered cache's (tiny random Llama, the embedded default model; alone and under a
codec), with pages on the host and, through a real lmdb directory, on disk; each sparse step
fetches from the host and disk exactly its chosen pages that lie off the device, at most ``top_k``
per head and fewer where its chunks are deserts; the device holds its page budget and the key
summaries (the abstracts), the host the rest; a directory that cannot hold a disk tier is refused
before any model work; the Engine refuses it (tiering), as it refuses the other tiering policies."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.policies.tiering.leoam import LeoAM
from kvlib.transformers_compat import cache_argument
from tests.adapters.cache.test_shadowkv import (
    assert_budget_on_the_device_the_rest_on_the_host,
    assert_covering_equals_the_untiered_cache,
    generate,
    page_mb,
)
from tests.adapters.conftest import DEFAULT_BYTES, assert_same_logits, build_model, left_padded


@pytest.mark.parametrize("family", ["llama", "default"])
def test_reading_every_chunk_equals_the_untiered_cache_with_pages_on_the_host(family: str) -> None:
    assert_covering_equals_the_untiered_cache(family, "leoam(top_k=100, desert=1000, dense_layers=0, placement='lru(device_mb={mb})')")


def test_under_a_codec_reading_every_chunk_equals_the_untiered_coded_cache() -> None:
    model = build_model("default")
    ids, mask = left_padded([90, 70], seed=5, vocab=DEFAULT_BYTES)
    reference = generate(model, ids, mask, kvlib.make_cache(model, "kivi(bits=4)"), steps=16)
    cache = kvlib.make_cache(model, "kivi(bits=4)+leoam(top_k=100, desert=1000, dense_layers=0, placement='lru(device_mb=0.004)')")
    out = generate(model, ids, mask, cache, steps=16)
    assert torch.equal(out.sequences, reference.sequences)
    assert cache.memory_report()["by_tier"]["host"] > 0


class RecordingLeoAM(LeoAM):
    """``leoam`` that records, per layer, the pages each sparse step read."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reads: dict[int, list[torch.Tensor]] = {}

    def select_pages(self, layer_idx, query, key_min, key_max, pages_used):
        read = super().select_pages(layer_idx, query, key_min, key_max, pages_used)
        self.reads.setdefault(layer_idx, []).append(read)
        return read


def test_each_step_fetches_its_chosen_pages_from_host_and_disk(scratch_registry, tmp_path) -> None:
    """Over a real lmdb directory: every decode step of a sparse layer copies exactly the chosen
    pages that lie off the device (from the host arena or their disk records), some from disk; the
    counters the policy keeps add up to what it chose."""
    kvlib.register("leoam_recording")(RecordingLeoAM)
    model = build_model("default")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    placement = f"lru(device_mb={page_mb(model, 2, 1)}, host_mb={page_mb(model, 3, 1)}, disk={str(tmp_path)!r}, disk_mb=16)"
    policy = RecordingLeoAM(top_k=4, chunk_pages=4, desert=4.0, dense_layers=1, placement=placement)
    cache = kvlib.make_cache(model, policy)
    from_disk = 0
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
        for step in range(12):  # crosses a page boundary (160 tokens)
            pools = cache.store.pools
            before = [(pool.pages_read, pool.host_pages_read) for pool in pools]
            model(input_ids=ids[:, step : step + 1], attention_mask=torch.ones(1, 151 + step, dtype=torch.long), **cache_argument(cache))
            for layer in range(1, layers):  # a layer's pages move at its write, before its read, and not after it in the step
                read = policy.reads[layer][-1]
                assert bool(((read >= 0).sum(-1) <= 4).all())
                table = cache.store.tables[layer].pages[cache.rows[0]]
                page_ids = torch.cat([table[head, read[0, head][read[0, head] >= 0]] for head in range(heads)]).unique()
                pool = pools[layer]
                fetched, from_host = pool.pages_read - before[layer][0], pool.host_pages_read - before[layer][1]
                assert fetched == int((pool.device_row[page_ids] < 0).sum()), (step, layer)
                assert fetched - from_host == int(pool.on_disk[page_ids].sum()), (step, layer)
                from_disk += fetched - from_host
    assert from_disk > 0
    assert all(pool.pages_on_disk > 0 for pool in cache.store.pools)
    assert 0 not in policy.reads  # the dense layer reads every page and judges none
    assert policy.steps == dict.fromkeys(range(1, layers), 12)
    assert policy.fetched == {layer: sum(int((read >= 0).sum()) for read in policy.reads[layer]) for layer in range(1, layers)}
    report = cache.memory_report()["by_tier"]
    assert report["host"] > 0 and report["disk"] > 0


def test_pages_on_disk_give_the_untiered_output_when_every_chunk_is_read(tmp_path) -> None:
    model = build_model("default")
    ids, mask = left_padded([75, 50], seed=3, vocab=DEFAULT_BYTES)
    reference = generate(model, ids, mask, steps=8)
    placement = f"lru(device_mb=0.001, host_mb=0.001, disk={str(tmp_path)!r}, disk_mb=16)"
    cache = kvlib.make_cache(model, f"leoam(top_k=100, desert=1000, dense_layers=0, placement={placement!r})")
    out = generate(model, ids, mask, cache, steps=8)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    assert all(pool.pages_on_disk > 0 for pool in cache.store.pools)


def test_deserts_make_steps_read_fewer_pages_than_top_k() -> None:
    """On the embedded model at a 300-token prompt, a narrow ``desert`` leaves many heads fewer
    than ``top_k`` pages to read; a wide one reads ``top_k`` everywhere."""
    model = build_model("default")
    ids, mask = left_padded([300], seed=8, vocab=DEFAULT_BYTES)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    fetched = {}
    for desert in (0.5, 1000.0):
        policy = LeoAM(top_k=6, desert=desert, dense_layers=0)
        generate(model, ids, mask, kvlib.make_cache(model, policy), steps=6)
        assert policy.steps == dict.fromkeys(range(layers), 5)  # the first new token comes from the prompt's call
        fetched[desert] = sum(policy.fetched.values())
    assert fetched[1000.0] == 6 * heads * layers * 5
    assert fetched[0.5] < 0.8 * fetched[1000.0]


def test_the_device_holds_its_page_budget_and_the_abstracts_the_host_the_rest() -> None:
    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    budget = 3
    cache = kvlib.make_cache(model, f"leoam(top_k=2, placement='lru(device_mb={page_mb(model, budget, 1)})')")
    generate(model, ids, mask, cache, steps=12)  # 161 tokens: 11 pages per head
    assert_budget_on_the_device_the_rest_on_the_host(cache, model, budget, pages=11)


def test_a_directory_that_cannot_hold_a_disk_tier_is_refused_before_model_work(tmp_path) -> None:
    (tmp_path / "file").write_bytes(b"")
    placement = f"lru(device_mb=0.001, host_mb=0.001, disk={str(tmp_path / 'file' / 'kv')!r})"
    with pytest.raises(ValueError, match=r"^leoam\(.*cannot create the directory .*spilled pages need a disk tier") as error:
        kvlib.make_cache(build_model("default"), f"leoam(top_k=2, placement={placement!r})")
    assert "\n" not in str(error.value)


def test_the_engine_refuses_it_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^the engine does not apply tiering or reuse policies yet \(leoam\(top_k=2\)\)"):
        kvlib.Engine(build_model("llama"), "leoam(top_k=2)")


def test_eviction_with_leoam_is_refused() -> None:
    with pytest.raises(ValueError, match="does not combine with eviction"):
        kvlib.make_cache(build_model("llama"), "snapkv+leoam", budget=32)


def test_a_lost_spilled_page_is_a_miss_for_page_retrieval_not_a_crash(tmp_path) -> None:
    """Spilled full pages' records damaged on disk mid-run (a byte flipped): the sparse steps leave
    those pages out of their selection (counted in ``lost_pages_missed``) and decode on; a read
    that needs every page (``lost="raise"``, the default) still raises, naming the page."""
    import struct

    from kvlib.storage.tiers.spill_store import SpilledPageLost

    model = build_model("default")
    ids, mask = left_padded([150], seed=4, vocab=DEFAULT_BYTES)
    placement = f"lru(device_mb={page_mb(model, 2, 1)}, host_mb={page_mb(model, 3, 1)}, disk={str(tmp_path)!r}, disk_mb=16)"
    cache = kvlib.make_cache(model, f"leoam(top_k=100, desert=1000, dense_layers=0, placement={placement!r})")
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, **cache_argument(cache))
    spill, tables = cache.spill, [pages.table for pages in cache.store.layers]
    row = cache.rows[0]
    used = [t.pages_used(t.lengths[row]) for t in tables]  # [kv heads] each
    last = {(layer, int(t.pages[row, h, used[layer][h] - 1])) for layer, t in enumerate(tables) for h in range(t.pages.shape[1])}
    keys = [key for key in spill.keys() if struct.unpack(">IQ", key[-12:]) not in last]  # full pages: the open ones are written next
    assert keys, "full pages were spilled"
    with spill.disk.env.begin(write=True) as txn:
        for key in keys:
            record = bytearray(txn.get(key, db=spill.spill))
            record[100] ^= 0x01
            txn.put(key, bytes(record), db=spill.spill)
    token = out.logits[:, -1:].argmax(-1)
    with torch.inference_mode():
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = model(input_ids=token, attention_mask=mask, **cache_argument(cache))
            token = out.logits[:, -1:].argmax(-1)
    assert torch.isfinite(out.logits).all()
    assert cache.store.lost_pages_missed > 0
    layer = next(index for index, pool in enumerate(cache.store.pools) if pool.pages_on_disk)
    every = torch.arange(int(used[layer].max())).expand(1, model.config.num_key_value_heads, -1)
    with pytest.raises(SpilledPageLost, match=r"spilled page \d+ of layer \d+ is lost: its record fails its checks") as error:
        cache.store.read_selected(layer, cache.rows, every.clone())
    assert error.value.pages
    missed = cache.store.lost_pages_missed
    read = cache.store.read_selected(layer, cache.rows, every.clone(), lost="miss")
    assert cache.store.lost_pages_missed > missed and bool(read.valid.any())
    with pytest.raises(ValueError, match="lost must be 'raise' or 'miss'"):
        cache.store.read_selected(layer, cache.rows, every.clone(), lost="skip")
