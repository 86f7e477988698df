"""Page prefetch: a read after a prefetch returns the same bytes as one without, takes only pages
unchanged since the prefetch started, and the pool never changes its tiers under a running job."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvlib.storage.pools.formats.tiered_format import TierBudgets, TieredPages
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.pools.page_prefetch import FetchedPages, PagePrefetcher
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.spill_store import LayerSpill, SpilledPageLost, SpillStore

PAGE, HEAD_DIM, VALUE_DIM = 4, 3, 2
CPU = torch.device("cpu")


def spilling_pool(directory: Path, spill_type: type[LayerSpill] = LayerSpill) -> tuple[PagePool, SpillStore]:
    """A pool keeping 2 pages on the device and 3 on the host, the rest on disk."""
    spill = SpillStore(DiskTier(directory, capacity_bytes=1), capacity_bytes=1 << 22)
    layer = spill.layer(0, PAGE, HEAD_DIM, VALUE_DIM, torch.float32)
    layer = spill_type(layer.store, layer.layer, layer.layout)
    return PagePool(
        page_size=PAGE,
        head_dim=HEAD_DIM,
        value_dim=VALUE_DIM,
        dtype=torch.float32,
        device=CPU,
        format=TieredPages(TierBudgets(device_pages=2, host_pages=3, disk_pages=64), spill=layer),
    ), spill


def write_pages(pool: PagePool, ids: torch.Tensor, seed: int) -> None:
    """Fill pages ``ids`` with distinct values (``seed`` tells writes apart)."""
    slots = (ids.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten()
    keys = torch.arange(slots.numel() * HEAD_DIM, dtype=torch.float32).view(-1, HEAD_DIM) + 1000 * seed
    values = -torch.arange(slots.numel() * VALUE_DIM, dtype=torch.float32).view(-1, VALUE_DIM) - 1000 * seed
    pool.write(slots, keys, values, slots % PAGE)


def filled_pool(directory: Path, spill_type: type[LayerSpill] = LayerSpill) -> tuple[PagePool, SpillStore, torch.Tensor]:
    pool, spill = spilling_pool(directory, spill_type)
    ids = pool.allocate(8)
    for page in ids:  # one page at a time: the earlier ones leave the device, then the host
        write_pages(pool, page.view(1), int(page))
    assert pool.pages_on_device == 2 and pool.pages_on_host == 3 and pool.pages_on_disk == 3
    return pool, spill, ids


def test_a_read_takes_the_prefetched_host_and_disk_pages_and_returns_the_same_bytes(tmp_path: Path) -> None:
    pool, spill, ids = filled_pool(tmp_path)
    expected = pool.read_pages(ids)
    pool.prefetch(torch.cat([ids, ids[:3]]), PagePrefetcher(CPU, fetch_host=True))  # repeats are fetched once
    keys, values = pool.read_pages(ids)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert pool.prefetched_pages_read == 6  # the 3 host and 3 disk pages; the device ones gathered
    pool.prefetch(ids, PagePrefetcher(CPU))  # on a CPU device host pages are read in place
    keys, values = pool.read_pages(ids)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1]) and pool.prefetched_pages_read == 9
    keys, values = pool.read_pages(ids)  # a read ends the prefetch: the next one fetches itself
    assert torch.equal(keys, expected[0]) and pool.prefetched_pages_read == 9
    spill.close()


def test_pages_written_freed_or_reused_after_a_prefetch_are_read_where_they_now_lie(tmp_path: Path) -> None:
    pool, spill, ids = filled_pool(tmp_path)
    reference = PagePool(
        page_size=PAGE, head_dim=HEAD_DIM, value_dim=VALUE_DIM, dtype=torch.float32, device=CPU, capacity=64
    )  # the same writes, untiered
    for page in ids:
        write_pages(reference, page.view(1), int(page))
    off_device = ids[pool.device_row[ids] < 0]
    pool.prefetch(ids, PagePrefetcher(CPU, fetch_host=True))
    write_pages(pool, off_device[:1], seed=77)  # rewritten (it comes back to the device)
    pool.decref(off_device[1:2])  # freed, then reused with new data
    reused = pool.allocate(1)
    assert torch.equal(reused, off_device[1:2])
    write_pages(pool, reused, seed=99)
    newest = pool.allocate(2)
    write_pages(pool, newest, seed=55)  # pushes the two changed pages off the device again
    assert bool((pool.device_row[off_device[:2]] < 0).all())
    for page, seed in ((off_device[:1], 77), (reused, 99), (newest, 55)):
        write_pages(reference, page, seed)
    everything = torch.cat([ids, newest])
    keys, values = pool.read_pages(everything)
    expected = reference.read_pages(everything)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    assert pool.prefetched_pages_read == off_device.numel() - 2  # the two changed pages were not taken
    spill.close()


class SlowSpill(LayerSpill):
    """A spill whose reads wait for :attr:`release` and note when they finish."""

    release = threading.Event()
    finished: list[float] = []

    def get(self, pages: torch.Tensor, device: torch.device, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        if threading.current_thread() is not threading.main_thread():
            self.release.wait(10)
            self.finished.append(time.monotonic())
        return super().get(pages, device, out)


def test_changes_to_the_tiers_wait_for_a_running_prefetch(tmp_path: Path) -> None:
    pool, spill, ids = filled_pool(tmp_path, SlowSpill)
    pool.prefetch(ids, PagePrefetcher(CPU))
    threading.Timer(0.2, SlowSpill.release.set).start()
    write_pages(pool, pool.allocate(2), seed=5)  # moves pages between all three tiers
    done = time.monotonic()
    assert SlowSpill.finished and SlowSpill.finished[0] <= done
    spill.close()


def test_a_lost_spilled_page_is_reported_by_the_read_not_by_the_prefetch(tmp_path: Path) -> None:
    pool, spill, ids = filled_pool(tmp_path)
    lost = ids[pool.on_disk[ids]][:1]
    with spill.disk.env.begin(write=True) as txn:
        txn.delete(pool.spill._key(int(lost)), db=spill.spill)
    pool.prefetch(ids, PagePrefetcher(CPU))
    write_pages(pool, ids[pool.device_row[ids] >= 0][:1], seed=3)  # waits for the failed job quietly
    with pytest.raises(SpilledPageLost, match=f"spilled page {int(lost)} "):
        pool.read_pages(ids)


def test_fetched_pages_match_only_unchanged_pages_in_use() -> None:
    fetched = FetchedPages(torch.tensor([7, 2, 5]), torch.tensor([1, 4, 9]), torch.arange(3.0).view(3, 1, 1), torch.zeros(3, 1, 1))
    ids = torch.tensor([2, 5, 7, 7, 3, 5])
    stamps = torch.tensor([4, 8, 1, 1, 0, 9])
    in_use = torch.tensor([True, True, True, False, True, True])
    matched, rows = fetched.match(ids, stamps, in_use)
    assert matched.tolist() == [True, False, True, False, False, True]
    assert rows[matched].tolist() == [1, 0, 2]
    empty = FetchedPages(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, 1), torch.zeros(0, 1, 1))
    assert not empty.match(ids, stamps, in_use)[0].any()
