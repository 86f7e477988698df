"""Spilling through generate: pages spread over device, host and disk give exactly the untiered
tokens and logits; budgets hold; records go with the pages; a full disk or an unusable directory
is a clear error."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import kvlib
from kvlib.model_shape import kv_shape
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import DEFAULT_BYTES, PAD, assert_same_logits, build_model, left_padded, prompt_vocab


def spec(model: torch.nn.Module, directory: Path, device_pages: int, host_pages: int, disk_mb: float = 64.0, prefetch: bool = True) -> str:
    """An ``lru`` spec keeping ``device_pages`` and ``host_pages`` pages per layer, the rest on disk."""
    shape = kv_shape(model)
    page_mb = 16 * (shape.head_dim + shape.value_dim) * next(model.parameters()).element_size() * shape.num_layers / 2**20
    return f"lru(device_mb={device_pages * page_mb + 1e-9}, host_mb={host_pages * page_mb + 1e-9}, disk={str(directory)!r}, disk_mb={disk_mb}, prefetch={prefetch})"


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("family", ["default", "llama"])
def test_generate_over_device_host_and_disk_equals_the_untiered_cache(family: str, prefetch: bool, tmp_path: Path) -> None:
    model = build_model(family)
    ids, mask = left_padded([90, 70], seed=3, vocab=prompt_vocab(family))
    options = {
        "attention_mask": mask,
        "max_new_tokens": 20,
        "do_sample": False,
        "pad_token_id": PAD,
        "return_dict_in_generate": True,
        "output_logits": True,
    }
    reference = model.generate(ids, **options)
    cache = kvlib.make_cache(model, spec(model, tmp_path, device_pages=4, host_pages=4, prefetch=prefetch))
    out = model.generate(ids, **cache_argument(cache), **options)
    assert torch.equal(out.sequences, reference.sequences)
    assert_same_logits(out.logits, reference.logits)
    pools = cache.store.pools
    assert all(pool.pages_on_device <= pool.device_pages and pool.pages_on_host <= pool.host_pages for pool in pools)
    assert all(pool.pages_on_device > 0 and pool.pages_on_host > 0 and pool.pages_on_disk > 0 for pool in pools)
    assert sum(pool.moves_to_disk for pool in pools) > sum(pool.pages_on_disk for pool in pools)  # pages came back too
    assert len(cache.spill.keys()) == sum(pool.pages_on_disk for pool in pools)
    prefetched = sum(pool.prefetched_pages_read for pool in pools)
    assert prefetched > sum(pool.host_pages_read for pool in pools) / 2 if prefetch else prefetched == 0  # most decode reads
    report = cache.memory_report()["by_tier"]
    assert report["disk"] == sum(pool.pages_on_disk * pool.kv_page_bytes for pool in pools) > 0
    cache.reset()  # freeing the pages deletes their records
    assert cache.spill.keys() == []


def test_beams_over_three_tiers_equal_the_untiered_cache(tmp_path: Path) -> None:
    model = build_model("default")
    ids, mask = left_padded([50, 41], seed=4, vocab=DEFAULT_BYTES)
    options = {"attention_mask": mask, "num_beams": 3, "max_new_tokens": 10, "do_sample": False, "pad_token_id": PAD}
    reference = model.generate(ids, **options)
    cache = kvlib.make_cache(model, spec(model, tmp_path, device_pages=3, host_pages=3))
    assert torch.equal(model.generate(ids, **cache_argument(cache), **options), reference)
    assert sum(pool.moves_to_disk for pool in cache.store.pools) > 0


def test_a_full_disk_tier_is_a_clear_error_and_bad_specs_are_refused(tmp_path: Path) -> None:
    model = build_model("default")
    ids, mask = left_padded([90], seed=6, vocab=DEFAULT_BYTES)
    cache = kvlib.make_cache(model, spec(model, tmp_path, device_pages=2, host_pages=2, disk_mb=0.01))
    with pytest.raises(kvlib.PoolExhaustedError, match="disk tier full"):
        model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    with pytest.raises(ValueError, match="set host_mb > 0"):
        kvlib.make_cache(model, f"lru(device_mb=0.01, disk={str(tmp_path)!r})")
    with pytest.raises(ValueError, match="disk_mb must be > 0"):
        kvlib.make_cache(model, f"lru(device_mb=0.01, host_mb=0.01, disk={str(tmp_path)!r}, disk_mb=0)")
    (tmp_path / "file").write_bytes(b"")  # a directory that cannot hold a disk tier: refused up front
    with pytest.raises(ValueError, match="cannot create the directory .*spilled pages need a disk tier"):
        kvlib.make_cache(model, spec(model, tmp_path / "file" / "kv", device_pages=2, host_pages=2))


def test_a_garbage_collected_cache_deletes_its_run(tmp_path: Path) -> None:
    model = build_model("llama")
    ids, mask = left_padded([80], seed=7, vocab=97)
    cache = kvlib.make_cache(model, spec(model, tmp_path, device_pages=2, host_pages=2))
    model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    disk, spilled = cache.spill.disk, len(cache.spill.keys())
    assert spilled > 0 and _entries(disk) == (spilled, 1)
    del cache
    gc.collect()
    assert _entries(disk) == (0, 0)


def _entries(disk) -> tuple[int, int]:
    """Spill records and registered runs in ``disk``."""
    with disk.env.begin() as txn:
        return txn.stat(disk.env.open_db(b"spill", txn=txn))["entries"], txn.stat(disk.env.open_db(b"runs", txn=txn))["entries"]


def test_a_prefix_store_and_a_spilling_cache_share_one_directory(tmp_path: Path) -> None:
    """lmdb allows one environment per file per process: both open the same DiskTier."""
    model = build_model("llama")
    prefixes = kvlib.PrefixStore(model, capacity_bytes=1 << 20, disk=tmp_path)
    ids, mask = left_padded([80], seed=8, vocab=97)
    cache = kvlib.make_cache(model, spec(model, tmp_path, device_pages=2, host_pages=2))
    model.generate(ids, attention_mask=mask, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    assert cache.spill.disk is prefixes.disk and cache.spill.keys()
    assert prefixes.disk.capacity_bytes == 4 << 20  # the prefix store's budget, not the spill-only one
