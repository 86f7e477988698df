"""A tiered pool moves pages in the order of the placement rule it was built with: off the device
when a page needs a row, from the host to disk when the host is full, and onto the device by a
ranking; a rule that does not return a permutation of its candidates is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlib.placement import PageStats, least_recently_written, lowest_score_first
from kvlib.storage.pools.formats.tiered_format import TierBudgets, TieredPages
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.spill_store import SpillStore

PAGE, HEAD_DIM, VALUE_DIM = 4, 3, 2
CPU = torch.device("cpu")


class Recorded:
    """A placement rule that records what it is asked and answers with ``rule``'s order."""

    def __init__(self, rule) -> None:
        self.rule = rule
        self.asked: list[PageStats] = []

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        self.asked.append(pages)
        return self.rule(pages)


def tiered(format: TieredPages) -> PagePool:
    """A pool of this module's shape whose pages are held in ``format``."""
    return PagePool(page_size=PAGE, head_dim=HEAD_DIM, value_dim=VALUE_DIM, dtype=torch.float32, device=CPU, format=format)


def newest_first(pages: PageStats) -> torch.Tensor:
    return pages.last_write.argsort(descending=True, stable=True)


def allocate_and_write(pool: PagePool, count: int) -> torch.Tensor:
    """Allocate ``count`` pages one at a time, each filled with its id as soon as it is taken."""
    ids = []
    for _ in range(count):
        page = int(pool.allocate(1))
        slots = page * PAGE + torch.arange(PAGE)
        pool.write(slots, torch.full((PAGE, HEAD_DIM), float(page)), torch.full((PAGE, VALUE_DIM), -float(page)), slots % PAGE)
        ids.append(page)
    return torch.tensor(ids)


def test_the_device_pages_that_leave_are_the_first_in_the_rules_order() -> None:
    """Four pages taken and written one at a time through a device of two: the default rule
    keeps the two written last on the device; newest-first keeps the first page and the last."""
    default = tiered(TieredPages(TierBudgets(2)))
    rule = Recorded(newest_first)
    reverse = tiered(TieredPages(TierBudgets(2, placement=rule)))
    for pool in (default, reverse):
        assert allocate_and_write(pool, 4).tolist() == [0, 1, 2, 3]
    assert (default.device_row >= 0).nonzero().flatten().tolist() == [2, 3]
    assert (reverse.device_row >= 0).nonzero().flatten().tolist() == [0, 3]
    assert rule.asked and all(stats.tier == "device" for stats in rule.asked)
    for pool in (default, reverse):  # the data never depends on where it lies
        keys, values = pool.read_pages(torch.arange(4))
        assert torch.equal(keys[:, 0, 0], torch.arange(4.0)) and torch.equal(values[:, 0, 0], -torch.arange(4.0))


def test_a_ranking_keeps_the_last_pages_of_the_order_on_the_device() -> None:
    rule = Recorded(lowest_score_first)
    pool = tiered(TieredPages(TierBudgets(2, placement=rule)))
    ids = allocate_and_write(pool, 5)
    asked = len(rule.asked)
    pool.rank(ids, torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0]))
    assert (pool.device_row >= 0).nonzero().flatten().tolist() == [0, 2]  # the two best-scored
    ranked = rule.asked[asked]  # every page in use, then the device pages the moves displace
    assert ranked.ids.tolist() == ids.tolist() and torch.equal(ranked.score, torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0]))


def test_host_pages_go_to_disk_in_the_rules_host_order(tmp_path: Path) -> None:
    spill = SpillStore(DiskTier(tmp_path, capacity_bytes=1), capacity_bytes=1 << 22)
    rule = Recorded(least_recently_written)
    pool = tiered(
        TieredPages(
            TierBudgets(device_pages=2, host_pages=2, disk_pages=64, placement=rule),
            spill=spill.layer(0, PAGE, HEAD_DIM, VALUE_DIM, torch.float32),
        )
    )
    ids = allocate_and_write(pool, 6)
    host_asks = [stats for stats in rule.asked if stats.tier == "host"]
    assert host_asks and pool.on_disk[ids].nonzero().flatten().tolist() == [0, 1]  # written first, spilled first
    keys, _ = pool.read_pages(ids)
    assert torch.equal(keys[:, 0, 0], ids.float())
    spill.close()
    spill.disk.close()


@pytest.mark.parametrize("answer", [lambda pages: torch.zeros_like(pages.ids), lambda pages: pages.ids[:-1] * 0])
def test_an_order_that_is_not_a_permutation_is_refused(answer) -> None:
    pool = tiered(TieredPages(TierBudgets(2, placement=Recorded(answer))))
    with pytest.raises(ValueError, match="must be a permutation"):
        allocate_and_write(pool, 3)
