"""Unit and property tests of storage/pools/page_pool.py: allocation, reference counts, growth, data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.errors import PoolExhaustedError
from kvlib.storage import PagePool


def make_pool(capacity: int = 4, fixed: bool = False) -> PagePool:
    return PagePool(page_size=4, head_dim=2, value_dim=3, dtype=torch.float32, device=torch.device("cpu"), capacity=capacity, fixed=fixed)


def test_allocate_hands_out_lowest_ids_first_and_counts_bytes() -> None:
    pool = make_pool()
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert pool.pages_in_use == 3 and pool.free_pages == 1
    assert pool.page_bytes == 4 * (2 + 3) * 4 + 4 * 8
    assert pool.bytes_in_use() == 3 * pool.page_bytes
    assert pool.bytes_reserved() == 4 * pool.page_bytes


def test_growable_pool_grows_to_what_it_needs_plus_a_margin_and_keeps_data() -> None:
    pool = make_pool(capacity=2)
    ids = pool.allocate(2)
    pool.write(ids * 4, torch.ones(2, 2), torch.ones(2, 3), torch.tensor([5, 6]))
    more = pool.allocate(3)
    assert pool.capacity == 5 + 16 and sorted(more.tolist()) == [2, 3, 4]  # at least 16 pages more
    pool.allocate(16)
    pool.allocate(1000)
    assert pool.capacity == 1021 + 1021 // 32  # a thirty-second more than needed
    keys, values, positions = pool.gather(ids * 4)
    assert torch.equal(keys, torch.ones(2, 2)) and positions.tolist() == [5, 6]


def test_reserve_grows_once_for_pages_taken_a_few_at_a_time_and_leaves_fixed_pools_alone() -> None:
    pool = make_pool(capacity=2)
    ids = pool.allocate(2)
    pool.write(ids * 4, torch.ones(2, 2), torch.ones(2, 3), torch.tensor([5, 6]))
    pool.reserve(400)
    reserved = pool.capacity
    assert reserved == grown_to(402) and pool.free_pages >= 400
    for _ in range(100):  # a prefix restored block by block: no growth, no copy
        pool.allocate(4)
    assert pool.capacity == reserved and pool.pages_in_use == 402
    assert pool.gather(ids * 4)[2].tolist() == [5, 6]
    pool.reserve(1)  # room already there: nothing changes
    assert pool.capacity == reserved
    fixed = make_pool(capacity=4, fixed=True)
    fixed.reserve(100)
    assert fixed.capacity == 4


def grown_to(pages: int) -> int:
    return pages + max(pages // 32, 16)


def test_relocate_then_shrink_moves_pages_and_gives_memory_back() -> None:
    pool = make_pool(capacity=8)
    ids = pool.allocate(8)
    pool.write(ids * 4, torch.arange(16.0).view(8, 2), torch.ones(8, 3), torch.arange(8) + 100)
    pool.incref(ids[6:7])  # page 6 held twice
    pool.decref(ids[:5])
    pool.relocate(torch.tensor([6, 7]), torch.tensor([1, 0]))
    assert pool.refcount.tolist() == [1, 2, 0, 0, 0, 1, 0, 0]
    keys, _, positions = pool.gather(torch.tensor([4, 0, 20]))
    assert keys[:, 0].tolist() == [12.0, 14.0, 10.0] and positions.tolist() == [106, 107, 105]
    pool.shrink(6)
    assert pool.capacity == 6 and pool.keys.shape[0] == 6 and pool.bytes_reserved() == 6 * pool.page_bytes
    assert sorted(pool.free_page_ids().tolist()) == [2, 3, 4]
    assert pool.allocate(3).tolist() == [2, 3, 4]  # lowest first
    with pytest.raises(ValueError, match="needs every page from 1 on free"):
        pool.shrink(1)
    with pytest.raises(ValueError, match="moves pages in use onto free pages"):
        pool.relocate(torch.tensor([0]), torch.tensor([1]))


def test_fixed_pool_raises_before_changing_anything() -> None:
    pool = make_pool(capacity=2, fixed=True)
    pool.allocate(1)
    with pytest.raises(PoolExhaustedError, match="2 pages requested, 1 free"):
        pool.allocate(2)
    assert pool.pages_in_use == 1 and pool.capacity == 2
    assert not pool.can_allocate(2) and pool.can_allocate(1)


def test_reference_counts_free_only_at_zero() -> None:
    pool = make_pool()
    ids = pool.allocate(2)
    pool.incref(ids[:1])
    pool.decref(ids)
    assert pool.refcount[ids].tolist() == [1, 0]
    assert pool.free_pages == 3
    pool.decref(torch.tensor([int(ids[0])]))
    assert pool.free_pages == 4


def test_double_free_and_incref_of_free_page_are_errors() -> None:
    pool = make_pool()
    ids = pool.allocate(1)
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(torch.cat([ids, ids]))
    assert pool.refcount[ids].tolist() == [1]
    pool.decref(ids)
    with pytest.raises(RuntimeError, match="free page"):
        pool.incref(ids)


def test_copy_pages_copies_keys_values_positions() -> None:
    pool = make_pool()
    a, b = pool.allocate(2).tolist()
    pool.write(torch.arange(4) + 4 * a, torch.randn(4, 2), torch.randn(4, 3), torch.arange(4))
    pool.copy_pages(torch.tensor([a]), torch.tensor([b]))
    assert torch.equal(pool.keys[a], pool.keys[b]) and torch.equal(pool.values[a], pool.values[b])
    assert torch.equal(pool.positions[a], pool.positions[b])


@pytest.mark.parametrize("bad", [{"page_size": 0}, {"head_dim": -1}, {"capacity": -1}])
def test_bad_arguments(bad: dict) -> None:
    args = {"page_size": 4, "head_dim": 2, "value_dim": 2, "dtype": torch.float32, "device": torch.device("cpu")}
    args.update(bad)
    with pytest.raises(ValueError):
        PagePool(**args)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=30))
def test_allocation_sequences_never_leak(ops: list[tuple[bool, int]]) -> None:
    """Random allocate/release: free + in use == capacity, no id twice, refcounts 0 or 1."""
    pool = make_pool(capacity=1)
    held: list[int] = []
    for allocate, n in ops:
        if allocate:
            held.extend(pool.allocate(n).tolist())
        elif held:
            release, held = held[:n], held[n:]
            pool.decref(torch.tensor(release))
        free = pool.free_page_ids().tolist()
        assert len(set(held)) == len(held) and not set(held) & set(free)
        assert len(free) + len(held) == pool.capacity == len(set(free)) + len(held)
        assert pool.bytes_in_use() == len(held) * pool.page_bytes
