"""A tiered coded pool moves sealed pages between device, host and disk as their encoded fields:
what lies on the host and in the spilled records is the codec's encoding of the page, bit for bit;
reads (dense, prefetched, and the paged kernel's, staging off-device pages) equal an untiered
coded pool's; key summaries come from the raw keys; open pages stay on the device."""

from __future__ import annotations

import math

import pytest
import torch

from kvlib.codec import layer_shapes
from kvlib.spec import parse_spec
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.formats.tiered_coded_format import TieredCodedPages
from kvlib.storage.pools.formats.tiered_format import TierBudgets
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.spill_store import SpillStore

PAGE, DIM, HEADS = 4, 8, 2
CPU = torch.device("cpu")


def codec(spec: str = "kivi(bits=4)"):
    """One layer's codec of the quantization policy ``spec``."""
    return parse_spec(spec).quantization.layer_codecs(layer_shapes(1, HEADS, DIM, DIM, PAGE, torch.float32, CPU))[0]


def shape() -> dict:
    return {"page_size": PAGE, "head_dim": DIM, "value_dim": DIM, "dtype": torch.float32, "device": CPU}


def fill(pools: list, count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate and write ``count`` full pages (heads alternating) into each of ``pools`` alike;
    returns their ids, keys and values ``[count, PAGE, DIM]``."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(count, PAGE, DIM, generator=generator)
    values = torch.randn(count, PAGE, DIM, generator=generator)
    heads = torch.arange(count) % HEADS
    for pool in pools:
        ids = pool.allocate(count, heads)
        slots = (ids.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten()
        pool.write(slots, keys.view(-1, DIM), values.view(-1, DIM), torch.arange(count * PAGE))
    return ids, keys, values


@pytest.mark.parametrize("spec", ["kivi(bits=4)", "int8", "fp8", "gear"])
def test_sealed_pages_move_encoded_and_read_as_the_untiered_pool_reads(spec: str, tmp_path) -> None:
    spill = SpillStore(DiskTier(tmp_path, capacity_bytes=1), capacity_bytes=1 << 24)
    tiered = PagePool(
        **shape(),
        format=TieredCodedPages(
            codec(spec),
            TierBudgets(device_pages=3, host_pages=3, disk_pages=100),
            spill_layer=lambda rows: spill.layer(0, 1, rows.key_bytes, rows.value_bytes, torch.uint8),
        ),
    )
    plain = PagePool(**shape(), format=CodedPages(codec(spec)))
    ids, keys, values = fill([tiered, plain], 12)
    sealed = ids[:10]
    for pool in (tiered, plain):
        pool.seal(sealed)
    tiers = tiered.tiers
    assert (tiered.pages_on_host, tiered.pages_on_disk, tiers.pages_on_device) == (3, 4, 3)
    assert tiered.pages_on_device == 2 + 3  # the two open pages stay on the device, beside the budget

    encoded = tiered.codec.encode(keys[:10], values[:10], sealed % HEADS)
    key_rows, value_rows = tiered.field_rows.pack(encoded)
    on_host = (tiers.host_row[tiered.tier_page[sealed]] >= 0).nonzero().flatten()
    host_keys, host_values = tiers.host.load(tiers.host_row[tiered.tier_page[sealed[on_host]]], CPU)
    assert torch.equal(host_keys, key_rows[on_host]) and torch.equal(host_values, value_rows[on_host])  # encoded, as encoded
    on_disk = tiers.on_disk[tiered.tier_page[sealed]].nonzero().flatten()
    disk_keys, disk_values = tiers.disk.get(tiered.tier_page[sealed[on_disk]], CPU)
    assert torch.equal(disk_keys, key_rows[on_disk]) and torch.equal(disk_values, value_rows[on_disk])
    assert tiered.tier_bytes()["host"] == 3 * tiered.codec.page_bytes() and tiered.tier_bytes()["disk"] == 4 * tiered.codec.page_bytes()

    for read in (tiered.read_pages(ids), tiered.gather(torch.arange(12 * PAGE)).__getitem__(slice(2))):
        expected = plain.read_pages(ids) if read[0].dim() == 3 else plain.gather(torch.arange(12 * PAGE))[:2]
        assert torch.equal(read[0], expected[0]) and torch.equal(read[1], expected[1])

    table = ids.view(1, HEADS, -1)  # each head's pages in order, its last one open
    lengths = torch.full((1, HEADS), table.shape[2] * PAGE)
    query = torch.randn(1, 2 * HEADS, 1, DIM, generator=torch.Generator().manual_seed(1))
    options = {"visible": None, "query_positions": torch.tensor([10**6]), "scale": 1 / math.sqrt(DIM)}
    paged = tiered.paged_layer(table, lengths)
    assert paged is not None and tiered.staged_bytes > 0
    assert torch.equal(paged.attend(query, **options), plain.paged_layer(table, lengths).attend(query, **options))
    assert tiers.pages_on_device == 3 and tiered.pages_on_host == 3  # reading moved nothing
    spill.close()


def test_prefetched_sealed_pages_read_the_same() -> None:
    tiered = PagePool(**shape(), format=TieredCodedPages(codec(), TierBudgets(device_pages=2)))
    ids, _, _ = fill([tiered], 8)
    tiered.seal(ids)
    expected = tiered.read_pages(ids)
    prefetcher = PagePrefetcher(CPU, fetch_host=True)
    tiered.prefetch(ids, prefetcher)
    read = tiered.read_pages(ids)
    assert tiered.tiers.prefetched_pages_read == 6
    assert torch.equal(read[0], expected[0]) and torch.equal(read[1], expected[1])
    prefetcher.close()


def test_key_summaries_are_the_raw_keys_and_frees_release_the_tiers() -> None:
    tiered = PagePool(**shape(), key_summaries=True, format=TieredCodedPages(codec("kivi(bits=2)"), TierBudgets(device_pages=2)))
    ids, keys, _ = fill([tiered], 6)
    tiered.seal(ids)
    assert torch.equal(tiered.summaries.key_min[ids], keys.amin(1)) and torch.equal(tiered.summaries.key_max[ids], keys.amax(1))
    assert not torch.equal(tiered.read_pages(ids)[0].amin(1), keys.amin(1))  # 2-bit keys differ from the raw ones
    copies = tiered.allocate(2)
    tiered.copy_pages(ids[:2], copies)  # copy-on-write of sealed pages: their fields, still sealed
    assert bool(tiered.sealed[copies].all()) and torch.equal(tiered.read_pages(copies)[0], tiered.read_pages(ids[:2])[0])
    tiered.decref(torch.cat([ids, copies]))
    assert tiered.tiers.pages_in_use == 0 and tiered.pages_on_host == 0 and bool((tiered.tier_page == -1).all())


@pytest.mark.parametrize(
    "bad",
    [{"device_pages": 0}, {"device_pages": 2, "spill_layer": lambda rows: None}],
)
def test_bad_budgets_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="device_pages must be|a disk tier needs"):
        PagePool(**shape(), format=TieredCodedPages(codec(), TierBudgets(bad["device_pages"]), bad.get("spill_layer")))
