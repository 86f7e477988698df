"""Targeted tests of storage/store/paged_store.py: errors, capacity, positions, read cache, memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, PoolExhaustedError, StoreConfig
from kvlib.storage.store.store_config import initial_arena_bytes


def step(batch: int, heads: int, tokens: int, dim: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, heads, tokens, dim, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def store() -> PagedStore:
    return PagedStore(StoreConfig(2, 2, 4, page_size=4, pages_per_layer=2))


def snapshot(store: PagedStore) -> list:
    return [
        (t.pages.clone(), t.lengths.clone(), t.logical.clone(), p.refcount.clone(), p.free_page_ids())
        for t, p in zip(store.tables, store.pools)
    ]


def assert_same(before: list, after: list) -> None:
    for a, b in zip(before, after):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_default_positions_continue_from_logical_length(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 5), step(1, 2, 5))
    store.compact(0, [seq], torch.tensor([[[0, 4], [1, 3]]]))
    store.append(0, [seq], step(1, 2, 2), step(1, 2, 2))
    read = store.read(0, [seq])
    assert read.positions[0].tolist() == [[0, 4, 5, 6], [1, 3, 5, 6]]
    assert store.logical_lengths(0, [seq]).tolist() == [7]
    assert store.physical_lengths(0, [seq]).tolist() == [[4, 4]]


def test_explicit_positions_broadcast_over_batch(store: PagedStore) -> None:
    a, b = store.new_sequence(), store.new_sequence()
    store.append(1, [a, b], step(2, 2, 3), step(2, 2, 3), torch.tensor([10, 11, 12]))
    assert store.read(1, [b, a]).positions[:, 0].tolist() == [[10, 11, 12]] * 2


def test_a_restored_sequence_continues_from_the_logical_length_set(store: PagedStore) -> None:
    """A sequence restored with the last tokens it had seen (a sliding window's) continues after
    the tokens it has seen, in the open-page fast path too; a length not past every stored
    position is refused before any change."""
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 3), step(1, 2, 3), torch.tensor([17, 18, 19]))
    for length in (19, 3, -1, 20.0):
        with pytest.raises(ValueError, match=f"past every stored position of sequence {seq} in layer 0, got {length!r}"):
            store.set_logical_length(0, seq, length)
    assert store.logical_lengths(0, [seq]).tolist() == [3]
    store.set_logical_length(0, seq, 20)
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1))
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1))
    assert store.read(0, [seq]).positions[0, 0].tolist() == [17, 18, 19, 20, 21]
    assert store.logical_lengths(0, [seq]).tolist() == [22]


def test_heads_of_different_lengths_read_with_a_mask(store: PagedStore) -> None:
    seq = store.new_sequence()
    keys = step(1, 2, 6)
    store.append(0, [seq], keys, keys)
    store.compact(0, [seq], torch.tensor([[[5, 0, -1], [2, 1, 4]]]))
    read = store.read(0, [seq])
    assert read.valid[0].tolist() == [[True, True, False], [True, True, True]]
    assert torch.equal(read.keys[0, 0, :2], keys[0, 0, [0, 5]])
    assert torch.equal(read.keys[0, 1], keys[0, 1, [1, 2, 4]])
    assert bool((read.keys[0, 0, 2] == 0).all())


def test_read_positions_gives_reads_positions_and_validity_without_keys_or_values(store: PagedStore) -> None:
    seqs = [store.new_sequence(), store.new_sequence()]
    keys = step(2, 2, 7)
    store.append(0, seqs, keys, keys)
    store.compact(0, seqs, torch.tensor([[[5, 0, -1], [2, 1, 4]], [[6, -1, -1], [0, 1, 2]]]), reuse_slots=True)
    read, positions = store.read(0, seqs, mirror=False), store.read_positions(0, seqs)
    assert torch.equal(positions.positions, read.positions) and torch.equal(positions.valid, read.valid)
    assert positions.keys.shape == (2, 2, 3, 0) and positions.values.shape == (2, 2, 3, 0)
    empty = store.read_positions(1, seqs)  # a layer holding nothing
    assert empty.positions.shape == (2, 2, 0) and empty.keys.shape == (2, 2, 0, 0)


def test_compaction_frees_pages_and_reports_bytes(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 16), step(1, 2, 16))
    assert store.pools[0].pages_in_use == 8
    store.compact(0, [seq], torch.tensor([[[0, 1, 15], [0, 1, 2]]]))
    assert store.pools[0].pages_in_use == 2
    memory = store.memory_bytes()
    assert memory["pages"] == 2 * 4 * (4 + 4) * 4
    assert memory["positions"] == 2 * 4 * 8
    assert store.bytes_in_use() == memory["pages"] + memory["positions"]


def test_compaction_with_new_values_rewrites_changed_heads_and_spares_shared_pages() -> None:
    store = PagedStore(StoreConfig(1, 2, 4, page_size=4))
    seq = store.new_sequence()
    keys, values = step(1, 2, 10), step(1, 2, 10, seed=1)
    store.append(0, [seq], keys, values)
    other = store.fork(seq)
    keep = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 9, -1, -1, -1, -1, -1]]])
    new_values = torch.full((1, 2, 10, 4), 7.0)
    store.compact(0, [seq], keep, new_values)
    read = store.read(0, [seq])
    assert torch.equal(read.values[0, 0], values[0, 0])  # head 0 dropped nothing: untouched
    assert torch.equal(read.values[0, 1, :5], torch.full((5, 4), 7.0))
    assert torch.equal(read.keys[0, 1, :5], keys[0, 1, [0, 1, 2, 3, 9]])
    assert torch.equal(store.read(0, [other]).values, values)  # the fork's shared pages are unchanged
    with pytest.raises(ValueError, match="values must have shape"):
        store.compact(0, [other], keep[..., :5], torch.zeros(1, 2, 4, 4))


def test_peak_page_bytes_records_the_high_water_mark(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 16), step(1, 2, 16))
    peak = store.memory_bytes()["pages"]
    store.compact(0, [seq], torch.tensor([[[0], [1]]]))
    assert store.peak_page_bytes == peak > store.memory_bytes()["pages"]


def test_read_cache_is_extended_in_place_by_appends(store: PagedStore) -> None:
    a, b = store.new_sequence(), store.new_sequence()
    store.append(0, [a, b], step(2, 2, 3), step(2, 2, 3))
    first = store.read(0, [a, b])
    store.append(0, [a, b], step(2, 2, 1, seed=1), step(2, 2, 1, seed=1))
    second = store.read(0, [a, b])
    assert second.keys.untyped_storage().data_ptr() == first.keys.untyped_storage().data_ptr()
    assert torch.equal(second.keys[:, :, 3:], step(2, 2, 1, seed=1))
    assert store.memory_bytes()["read_cache"] > 0


def test_read_cache_dropped_by_compaction_and_other_batches(store: PagedStore) -> None:
    a, b = store.new_sequence(), store.new_sequence()
    store.append(0, [a, b], step(2, 2, 3), step(2, 2, 3))
    store.read(0, [a, b])
    store.append(0, [a], step(1, 2, 1), step(1, 2, 1))  # a different batch: the mirror is dropped
    assert store.read(0, [a, b]).valid[:, 0].sum(-1).tolist() == [4, 3]
    store.compact(0, [a, b], torch.tensor([[[0], [1]], [[2], [0]]]))
    assert store.read(0, [a, b]).keys.shape[2] == 1


def test_store_without_read_cache_returns_fresh_tensors() -> None:
    store = PagedStore(StoreConfig(1, 2, 4, read_cache=False))
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 3), step(1, 2, 3))
    assert store.read(0, [seq]).keys.shape == (1, 2, 3, 4)
    assert store.memory_bytes()["read_cache"] == 0


def test_fork_shares_pages_until_written(store: PagedStore) -> None:
    parent = store.new_sequence()
    keys = step(1, 2, 6)
    store.append(0, [parent], keys, keys)
    child = store.fork(parent)
    assert store.pools[0].pages_in_use == 4
    store.append(0, [child], step(1, 2, 1, seed=3), step(1, 2, 1, seed=3))
    assert store.pools[0].pages_in_use == 6  # the shared open pages were copied, full ones stay shared
    assert torch.equal(store.read(0, [parent]).keys, keys)
    store.release([parent])
    assert store.pools[0].pages_in_use == 4


def test_fixed_capacity_append_and_compaction_fail_without_changes() -> None:
    store = PagedStore(StoreConfig(1, 2, 4, page_size=4, pages_per_layer=4, fixed_capacity=True))
    a, b = store.new_sequence(), store.new_sequence()
    store.append(0, [a], step(1, 2, 8), step(1, 2, 8))
    before = snapshot(store)
    with pytest.raises(PoolExhaustedError, match="needs 2 pages, 0 free"):
        store.append(0, [b], step(1, 2, 1), step(1, 2, 1))
    assert_same(before, snapshot(store))
    child = store.fork(a)
    before = snapshot(store)
    with pytest.raises(PoolExhaustedError):
        store.compact(0, [child], torch.tensor([[[1, 2], [1, 2]]]))
    assert_same(before, snapshot(store))


def test_failed_append_does_not_widen_the_block_table() -> None:
    store = PagedStore(StoreConfig(1, 1, 4, page_size=1, pages_per_layer=1, fixed_capacity=True))
    seq = store.new_sequence()
    before = snapshot(store)
    with pytest.raises(PoolExhaustedError):
        store.append(0, [seq], step(1, 1, 5), step(1, 1, 5))
    assert_same(before, snapshot(store))
    assert store.tables[0].pages.shape == (1, 1, 1)


def test_sharers_appending_together_copy_only_what_they_must() -> None:
    """A forked open page appended by both sharers in one batch needs one copy, not two."""
    store = PagedStore(StoreConfig(1, 1, 4, page_size=4, pages_per_layer=2, fixed_capacity=True))
    parent = store.new_sequence()
    store.append(0, [parent], step(1, 1, 2), step(1, 1, 2))
    child = store.fork(parent)
    store.append(0, [parent, child], step(2, 1, 1, seed=1), step(2, 1, 1, seed=1))
    assert store.pools[0].pages_in_use == 2 and store.pools[0].refcount.tolist() == [1, 1]
    read = store.read(0, [parent, child])
    assert torch.equal(read.keys[:, :, 2], step(2, 1, 1, seed=1)[:, :, 0])
    assert torch.equal(read.keys[0, :, :2], read.keys[1, :, :2])


def test_per_layer_shapes() -> None:
    store = PagedStore(StoreConfig(2, [1, 3], [2, 5], value_dim=[4, 1]))
    seq = store.new_sequence()
    store.append(1, [seq], torch.zeros(1, 3, 2, 5), torch.zeros(1, 3, 2, 1))
    assert store.read(1, [seq]).values.shape == (1, 3, 2, 1)
    with pytest.raises(ValueError, match=r"kv_heads=1, tokens, head_dim=2"):
        store.append(0, [seq], torch.zeros(1, 3, 2, 5), torch.zeros(1, 3, 2, 1))


@pytest.mark.parametrize(
    ("keys", "values", "positions", "message"),
    [
        (torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4), None, "dtype torch.float64"),
        (torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 4), None, "keys must be"),
        (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), None, "batch=1"),
        (torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4), None, "values must be"),
        (torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 3, dtype=torch.long), "shape"),
        (torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 1), "integer tensor"),
        (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.tensor([7]), "shape"),
        (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.tensor([7, 8, 9, 10]), "shape"),
        ([0.0], torch.zeros(1, 2, 1, 4), None, "must be a torch.Tensor"),
    ],
)
def test_bad_append_changes_nothing(store: PagedStore, keys, values, positions, message: str) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 2), step(1, 2, 2))
    before = snapshot(store)
    with pytest.raises(ValueError, match=message):
        store.append(0, [seq], keys, values, positions)
    assert_same(before, snapshot(store))


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (torch.tensor([[[0, 3], [0, 1]]]), r"in \[0, physical length\)"),
        (torch.tensor([[[0, -2], [0, 1]]]), r"-1 \(padding\)"),
        (torch.tensor([[[1, 1], [0, 1]]]), "repeat"),
        (torch.tensor([[0, 1]]), "shape"),
        (torch.tensor([[[0.0, 1.0], [0.0, 1.0]]]), "integer tensor"),
    ],
)
def test_bad_compaction_changes_nothing(store: PagedStore, keep: torch.Tensor, message: str) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 3), step(1, 2, 3))
    before = snapshot(store)
    with pytest.raises(ValueError, match=message):
        store.compact(0, [seq], keep)
    assert_same(before, snapshot(store))


def test_bad_sequence_and_layer_ids(store: PagedStore) -> None:
    seq = store.new_sequence()
    with pytest.raises(ValueError, match="unknown or released"):
        store.read(0, [seq + 1])
    with pytest.raises(ValueError, match="repeat"):
        store.read(0, [seq, seq])
    with pytest.raises(ValueError, match="at least one"):
        store.read(0, [])
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        store.read(2, [seq])
    store.release([seq])
    with pytest.raises(ValueError, match="unknown or released"):
        store.fork(seq)


@pytest.mark.parametrize("bad", [[1.0], (1.0,), torch.tensor([1.0])])
def test_float_ids_are_rejected_even_after_the_same_batch(store: PagedStore, bad) -> None:
    store.new_sequence()
    seq = store.new_sequence()
    with pytest.raises(ValueError, match="unknown or released"):
        store.read(0, bad)  # rejected: 1.0 is not an int id
    store.read(0, [seq])
    with pytest.raises(ValueError, match="unknown or released"):
        store.read(0, bad)


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"page_size": 0}, {"num_kv_heads": [1]}, {"head_dim": 0}])
def test_bad_store_arguments(bad: dict) -> None:
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
    args.update(bad)
    with pytest.raises(ValueError):
        PagedStore(StoreConfig(**args))


def no_pools(*args, **kwargs):
    raise AssertionError("a page pool was built")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"page_size": 10**6}, r"page_size=1000000 is over the limit of 4096 tokens per page"),
        ({"page_size": 16.0}, r"page_size must be an int >= 1 \(tokens per page\), got 16.0"),
        ({"pages_per_layer": -1}, r"pages_per_layer must be an int >= 0, got -1"),
        ({"pages_per_layer": 0, "fixed_capacity": True}, r"pages_per_layer must be an int >= 1, got 0"),
        (
            {"pages_per_layer": 2**40},
            r"a store of 2 layers with pages_per_layer=1099511627776 of page_size=16 tokens would"
            r" allocate \d+ bytes \(.* GiB\) on cpu up front, more than the \d+ bytes",
        ),
    ],
)
def test_sizes_are_bounded_before_any_pool_is_built(monkeypatch, bad: dict, message: str) -> None:
    monkeypatch.setattr("kvlib.storage.store.pool_factory.PagePool", no_pools)
    with pytest.raises(ValueError, match=message):
        PagedStore(StoreConfig(2, 2, 64, **bad))


def test_what_the_first_arenas_take_is_checked_against_available_memory(monkeypatch) -> None:
    """2 layers, 64 pages of 16 tokens, 4 + 4 float32 channels and int64 positions: 2 * 64 * 16
    * (8 * 4 + 8) bytes; one byte less available and the store is refused before a pool exists."""
    needed = 2 * 64 * 16 * (8 * 4 + 8)
    assert initial_arena_bytes([4, 4], [4, 4], 16, torch.float32, 64) == needed
    monkeypatch.setattr("kvlib.devices.available_bytes", lambda device: needed - 1)
    monkeypatch.setattr("kvlib.storage.store.pool_factory.PagePool", no_pools)
    with pytest.raises(ValueError, match=rf"would allocate {needed} bytes .* on cpu up front, more than the {needed - 1} bytes"):
        PagedStore(StoreConfig(2, 2, 4))
    monkeypatch.undo()
    monkeypatch.setattr("kvlib.devices.available_bytes", lambda device: needed)
    assert PagedStore(StoreConfig(2, 2, 4)).memory_bytes()["reserved"] == needed  # the estimate is what is taken


def test_a_drained_store_gives_back_its_mirrors_and_table_rows() -> None:
    store = PagedStore(StoreConfig(2, 2, 4, page_size=4))
    empty = store.memory_bytes()
    seqs = [store.new_sequence() for _ in range(5)]
    for layer in range(2):
        store.append(layer, seqs, step(5, 2, 30), step(5, 2, 30))
        store.read(layer, seqs)
    grown = store.memory_bytes()
    assert grown["tables"] > empty["tables"] and grown["read_cache"] > 0
    assert grown["reserved"] > empty["reserved"]  # 80 pages per layer: the arenas grew
    store.release(seqs[:4])
    after = store.memory_bytes()
    assert after["tables"] == grown["tables"]  # one sequence still live: its table rows stay
    assert after["reserved"] == empty["reserved"]  # 16 pages in use of 80: the arenas shrink (to 64, the first size)
    assert store.read(0, seqs[4:]).keys.shape == (1, 2, 30, 4)
    store.release(seqs[4:])
    assert store.memory_bytes() == empty
    seq = store.new_sequence()
    assert seq == 0
    store.append(0, [seq], step(1, 2, 3), step(1, 2, 3))
    assert store.read(0, [seq]).keys.shape == (1, 2, 3, 4)


# -- truncate ------------------------------------------------------------------------------------


def full_state(store: PagedStore) -> list:
    """Tables, reference counts, free lists and the arenas' contents (what a failed call must not change)."""
    return [(*layer, pool.keys.clone(), pool.values.clone(), pool.positions.clone()) for layer, pool in zip(snapshot(store), store.pools)]


def assert_reads_equal(got, expected) -> None:
    assert got.keys.shape == expected.keys.shape
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_truncate_drops_the_suffix_and_releases_its_pages(store: PagedStore) -> None:
    seq = store.new_sequence()
    keys = step(1, 2, 10)
    store.append(0, [seq], keys, -keys)
    store.append(1, [seq], keys, -keys)
    bytes_before = store.bytes_in_use()
    assert store.pools[0].pages_in_use == 6
    store.truncate(0, [seq], 5)
    assert store.pools[0].pages_in_use == 4  # each head keeps page 0 and the partly kept page 1
    assert store.bytes_in_use() == bytes_before - 2 * store.pools[0].page_bytes
    assert store.physical_lengths(0, [seq]).tolist() == [[5, 5]]
    assert store.logical_lengths(0, [seq]).tolist() == [5]
    assert store.stored_positions(0, [seq]).tolist() == [[list(range(5))] * 2]
    read = store.read(0, [seq])
    assert torch.equal(read.keys, keys[:, :, :5]) and torch.equal(read.values, -keys[:, :, :5])
    assert read.positions.tolist() == [[list(range(5))] * 2]
    # the other layer is untouched
    assert store.physical_lengths(1, [seq]).tolist() == [[10, 10]] and store.pools[1].pages_in_use == 6
    assert torch.equal(store.read(1, [seq]).keys, keys)


def test_truncate_takes_a_length_per_sequence(store: PagedStore) -> None:
    """One call rolls a batch back to lengths of its own (what rejected drafts of several requests
    need); a bad list changes nothing."""
    seqs = [store.new_sequence(), store.new_sequence(), store.new_sequence()]
    keys = step(3, 2, 10)
    store.append(0, seqs, keys, -keys)
    with pytest.raises(ValueError, match="one int per sequence"):
        store.truncate(0, seqs, [5, 9])
    with pytest.raises(ValueError, match="length must be an int"):
        store.truncate(0, seqs, [5, -1, 9])
    assert store.physical_lengths(0, seqs).tolist() == [[10, 10]] * 3
    store.truncate(0, seqs, [5, 10, 1])
    assert store.physical_lengths(0, seqs).tolist() == [[5, 5], [10, 10], [1, 1]]
    assert store.logical_lengths(0, seqs).tolist() == [5, 10, 1]
    for row, length in enumerate((5, 10, 1)):
        read = store.read(0, [seqs[row]])
        assert torch.equal(read.keys, keys[row : row + 1, :, :length])
    assert store.pools[0].pages_in_use == 2 * (2 + 3 + 1)  # pages of 4 tokens: 5, 10 and 1 tokens a head


def test_appends_after_truncate_continue_at_the_new_end(store: PagedStore) -> None:
    seq = store.new_sequence()
    keys = step(1, 2, 10)
    store.append(0, [seq], keys, -keys)
    store.truncate(0, [seq], 6)
    new = step(1, 2, 5, seed=1)
    store.append(0, [seq], new[:, :, :1], -new[:, :, :1])  # overwrites the stale slot 6 in the kept page
    store.append(0, [seq], new[:, :, 1:], -new[:, :, 1:])  # fills that page, then a fresh one
    expect = torch.cat([keys[:, :, :6], new], 2)
    read = store.read(0, [seq])
    assert torch.equal(read.keys, expect) and torch.equal(read.values, -expect)
    assert read.positions.tolist() == [[list(range(11))] * 2]
    assert store.logical_lengths(0, [seq]).tolist() == [11]
    assert store.pools[0].pages_in_use == 6


def test_truncate_to_zero_frees_every_page(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 7), step(1, 2, 7))
    store.truncate(0, [seq], 0)
    assert store.pools[0].pages_in_use == 0 and store.bytes_in_use() == 0
    assert store.physical_lengths(0, [seq]).tolist() == [[0, 0]]
    assert store.logical_lengths(0, [seq]).tolist() == [0]
    assert store.stored_positions(0, [seq]).shape == (1, 2, 0)
    assert (store.tables[0].pages[seq] == -1).all()
    store.append(0, [seq], step(1, 2, 2, seed=1), step(1, 2, 2, seed=1))
    assert store.read(0, [seq]).positions.tolist() == [[[0, 1], [0, 1]]]


def test_truncate_beyond_the_end_only_lowers_the_logical_length(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 6), step(1, 2, 6))
    store.compact(0, [seq], torch.tensor([[[0, 1], [1, 2]]]))  # positions [0, 1] and [1, 2]
    before = snapshot(store)
    store.truncate(0, [seq], 9)  # above the logical length: nothing at all changes
    assert_same(before, snapshot(store))
    store.truncate(0, [seq], 4)  # no stored token is dropped, but the logical length falls to 4
    assert store.physical_lengths(0, [seq]).tolist() == [[2, 2]]
    assert store.logical_lengths(0, [seq]).tolist() == [4]
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1))
    assert store.read(0, [seq]).positions.tolist() == [[[0, 1, 4], [1, 2, 4]]]


def test_truncate_heads_and_sequences_of_different_lengths(store: PagedStore) -> None:
    a, b = store.new_sequence(), store.new_sequence()
    store.append(0, [a], step(1, 2, 9), step(1, 2, 9))
    store.append(0, [b], step(1, 2, 3, seed=1), step(1, 2, 3, seed=1))
    store.compact(0, [a], torch.tensor([[[0, 4, 5, 8], [1, 2, 3, 6]]]))
    store.truncate(0, [a, b], 4)
    assert store.physical_lengths(0, [a, b]).tolist() == [[1, 3], [3, 3]]
    assert store.logical_lengths(0, [a, b]).tolist() == [4, 3]
    assert store.stored_positions(0, [a, b]).tolist() == [[[0, -1, -1], [1, 2, 3]], [[0, 1, 2], [0, 1, 2]]]
    assert store.pools[0].pages_in_use == 4


def test_truncate_of_a_forked_sequence_keeps_the_sharer_and_copies_on_write(store: PagedStore) -> None:
    parent = store.new_sequence()
    keys = step(1, 2, 7)
    store.append(0, [parent], keys, -keys)
    child = store.fork(parent)
    store.truncate(0, [child], 2)
    assert store.pools[0].pages_in_use == 4  # the dropped page is still the parent's
    assert store.pools[0].refcount[store.tables[0].pages[child, :, 0]].tolist() == [2, 2]
    assert torch.equal(store.read(0, [parent]).keys, keys)
    assert torch.equal(store.read(0, [child]).keys, keys[:, :, :2])
    new = step(1, 2, 3, seed=1)
    store.append(0, [child], new, -new)  # the partly kept page is shared: copied, not written
    assert store.pools[0].pages_in_use == 8  # parent 2 pages per head; child a copy and a fresh page per head
    parent_read = store.read(0, [parent])
    assert torch.equal(parent_read.keys, keys) and torch.equal(parent_read.values, -keys)
    assert parent_read.positions.tolist() == [[list(range(7))] * 2]
    child_read = store.read(0, [child])
    assert torch.equal(child_read.keys, torch.cat([keys[:, :, :2], new], 2))
    assert child_read.positions.tolist() == [[list(range(5))] * 2]
    store.truncate(0, [parent], 1)
    assert torch.equal(store.read(0, [child]).keys, torch.cat([keys[:, :, :2], new], 2))
    store.release([parent, child])
    assert store.pools[0].pages_in_use == 0


def test_truncate_of_a_non_suffix_changes_nothing(store: PagedStore) -> None:
    a, b = store.new_sequence(), store.new_sequence()
    store.append(0, [a, b], step(2, 2, 3), step(2, 2, 3))
    store.append(0, [b], step(1, 2, 2, seed=1), step(1, 2, 2, seed=1), torch.tensor([9, 1]))  # b: 0 1 2 9 1
    store.read(0, [a, b])
    before = full_state(store)
    for length in (2, 3, 5, 9):  # a alone could be truncated, but b keeps its last token (1): the batch fails
        with pytest.raises(ValueError, match="not a suffix"):
            store.truncate(0, [a, b], length)
        assert_same(before, full_state(store))
    read = store.read(0, [a, b])
    assert read.positions[:, 0].tolist() == [[0, 1, 2, -1, -1], [0, 1, 2, 9, 1]]
    store.truncate(0, [a, b], 10)  # drops nothing stored and leaves the logical lengths (3 and 5)
    assert store.logical_lengths(0, [a, b]).tolist() == [3, 5]
    assert_same(before, full_state(store))
    store.truncate(0, [b], 1)  # positions >= 1 are slots 1..4 of b: a suffix
    assert store.physical_lengths(0, [b]).tolist() == [[1, 1]]
    assert store.logical_lengths(0, [a, b]).tolist() == [3, 1]


@pytest.mark.parametrize("length", [-1, True, False, 2.0, None, "2", torch.tensor(2)])
def test_truncate_rejects_bad_lengths_without_changes(store: PagedStore, length) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 5), step(1, 2, 5))
    before = full_state(store)
    with pytest.raises(ValueError, match="length must be an int"):
        store.truncate(0, [seq], length)
    assert_same(before, full_state(store))


def test_truncate_rejects_bad_layers_and_ids(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 5), step(1, 2, 5))
    before = full_state(store)
    with pytest.raises(ValueError, match="layer must be"):
        store.truncate(2, [seq], 1)
    with pytest.raises(ValueError, match="unknown or released"):
        store.truncate(0, [seq + 1], 1)
    with pytest.raises(ValueError, match="repeat"):
        store.truncate(0, [seq, seq], 1)
    assert_same(before, full_state(store))


def build_twins() -> tuple[PagedStore, PagedStore]:
    """A store with the read mirror and one without, for comparing reads."""
    return tuple(PagedStore(StoreConfig(1, 2, 4, page_size=4, pages_per_layer=2, read_cache=flag)) for flag in (True, False))


@pytest.mark.parametrize("lengths", [(5, 5), (8, 3), (0, 2), (4, 4), (20, 20)])
def test_truncate_keeps_the_read_mirror_in_step(lengths: tuple[int, int]) -> None:
    stores = build_twins()
    for store in stores:
        a, b = store.new_sequence(), store.new_sequence()
        store.append(0, [a, b], step(2, 2, 9), -step(2, 2, 9))
        store.compact(0, [a, b], torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 2, 3, 5, 7, 8, -1, -1, -1]]] * 2))
    mirrored, plain = stores
    first = mirrored.read(0, [a, b])
    for length in lengths:
        for store in stores:
            store.truncate(0, [a, b], length)
        got = mirrored.read(0, [a, b])
        assert got.keys.untyped_storage().data_ptr() == first.keys.untyped_storage().data_ptr()  # in place
        assert_reads_equal(got, plain.read(0, [a, b]))
        assert_reads_equal(got, mirrored._gather(0, torch.tensor([a, b]), got.keys.shape[2]))
    for tokens in (1, 3, 1, 6):  # appends after the truncation extend the mirror correctly
        keys = step(2, 2, tokens, seed=tokens)
        for store in stores:
            store.append(0, [a, b], keys, -keys)
        assert_reads_equal(mirrored.read(0, [a, b]), plain.read(0, [a, b]))


def test_truncate_drops_the_mirror_of_another_batch() -> None:
    mirrored, plain = build_twins()
    for store in (mirrored, plain):
        a, b = store.new_sequence(), store.new_sequence()
        store.append(0, [a, b], step(2, 2, 6), step(2, 2, 6))
    mirrored.read(0, [a, b])
    for store in (mirrored, plain):
        store.truncate(0, [b], 3)
    assert mirrored.read_caches[0] is None
    assert_reads_equal(mirrored.read(0, [a, b]), plain.read(0, [a, b]))
    assert_reads_equal(mirrored.read(0, [b, a]), plain.read(0, [b, a]))


def test_stored_positions_shape_padding_and_device(store: PagedStore) -> None:
    a, b = store.new_sequence(), store.new_sequence()
    assert store.stored_positions(0, [a, b]).shape == (2, 2, 0)
    store.append(0, [a, b], step(2, 2, 3), step(2, 2, 3), torch.tensor([[4, 5, 6], [7, 8, 9]]))
    store.compact(0, [a, b], torch.tensor([[[0, 2], [1, -1]], [[0, 1], [0, 1]]]))
    positions = store.stored_positions(0, [b, a])
    assert positions.dtype == torch.int64 and positions.device.type == "cpu"
    assert positions.tolist() == [[[7, 8], [7, 8]], [[4, 6], [5, -1]]]
    assert torch.equal(positions, store.read(0, [b, a]).positions)


# -- append fast path (tokens written straight into the batch's open pages) ----------------------


class Twin:
    """The store under test, appended with default positions (so the fast path runs where it
    applies), and a reference store given the same positions explicitly (always the slow path,
    no read mirror). Every operation goes to both; ``check`` compares them."""

    def __init__(self, read_cache: bool = True, layers: int = 1, heads: int = 2, **kwargs) -> None:
        kwargs = {"page_size": 4, "pages_per_layer": 1, **kwargs}
        self.store = PagedStore(StoreConfig(layers, heads, 4, read_cache=read_cache, **kwargs))
        self.reference = PagedStore(StoreConfig(layers, heads, 4, read_cache=False, **kwargs))
        self.heads = heads
        self.seed = 0

    def both(self, method: str, *args):
        result = getattr(self.store, method)(*args)
        expected = getattr(self.reference, method)(*args)
        assert torch.equal(expected, result) if isinstance(result, torch.Tensor) else expected == result
        return result

    def append(self, layer: int, seqs: list[int], tokens: int) -> torch.Tensor:
        self.seed += 1
        keys = step(len(seqs), self.heads, tokens, seed=self.seed)
        positions = self.reference.logical_lengths(layer, seqs).unsqueeze(-1) + torch.arange(tokens)
        self.store.append(layer, seqs, keys, -keys)
        self.reference.append(layer, seqs, keys, -keys, positions)
        return keys

    def check(self, layer: int, seqs: list[int]) -> None:
        """The batch reads the same through ``read`` (the mirror, if on); every live sequence and
        every page count agree too."""
        assert_reads_equal(self.store.read(layer, seqs), self.reference.read(layer, seqs))
        live = torch.tensor(self.store.sequences)
        for ours, theirs in zip(self.store.tables, self.reference.tables):
            assert torch.equal(ours.lengths[live], theirs.lengths[live])
            assert torch.equal(ours.logical[live], theirs.logical[live])
        for ours, theirs in zip(self.store.pools, self.reference.pools):
            assert ours.pages_in_use == theirs.pages_in_use
        for layer_ in range(len(self.store.tables)):
            for seq in self.store.sequences:
                rows = torch.tensor([seq])
                size = int(self.store.physical_lengths(layer_, [seq]).max())
                assert_reads_equal(self.store._gather(layer_, rows, size), self.reference._gather(layer_, rows, size))


@pytest.fixture
def fast_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], int]]:
    """(batch, tokens) of every append that took the fast path."""
    calls = []
    original = PagedStore._append_in_open_pages

    def spy(self, layer, rows, open_pages, keys, values):
        calls.append((tuple(rows.tolist()), keys.shape[2]))
        return original(self, layer, rows, open_pages, keys, values)

    monkeypatch.setattr(PagedStore, "_append_in_open_pages", spy)
    return calls


@pytest.mark.parametrize("read_cache", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_one_token_steps_across_page_boundaries(fast_steps: list, read_cache: bool, batch_size: int) -> None:
    twin = Twin(read_cache)
    batch = [twin.both("new_sequence") for _ in range(batch_size)]
    appended = []
    for _ in range(13):
        appended.append(twin.append(0, batch, 1))
        twin.check(0, batch)
    assert len(fast_steps) == 9  # slow at lengths 0, 4, 8, 12 (a new page), fast in between
    read = twin.store.read(0, batch)
    assert torch.equal(read.keys, torch.cat(appended, 2))
    assert read.positions[:, 0].tolist() == [list(range(13))] * batch_size
    assert twin.store.pools[0].pages_in_use == 4 * 2 * batch_size


@pytest.mark.parametrize("read_cache", [True, False])
def test_several_token_steps_that_fill_the_open_page(fast_steps: list, read_cache: bool) -> None:
    twin = Twin(read_cache)
    a, b = twin.both("new_sequence"), twin.both("new_sequence")
    for tokens in (1, 3, 2, 2, 0, 1, 1, 4, 3, 1):
        twin.append(0, [a, b], tokens)
        twin.check(0, [a, b])
    # page_size 4: after 1 token, 3 exactly fill the page; after 6, 2 fill it; after 9, 1 fits; ...
    assert [tokens for _, tokens in fast_steps] == [3, 2, 0, 1, 1]
    assert twin.store.physical_lengths(0, [a, b]).tolist() == [[18, 18]] * 2


def test_heads_of_different_lengths_on_the_fast_path(fast_steps: list) -> None:
    twin = Twin(heads=3)
    a, b = twin.both("new_sequence"), twin.both("new_sequence")
    twin.append(0, [a, b], 6)
    keep = torch.tensor([[[0, 1, 2, 3, 4], [0, -1, -1, -1, -1], [1, 2, -1, -1, -1]], [[0, 1, 2, 3, 4]] * 3])
    twin.both("compact", 0, [a, b], keep)  # lengths [5, 1, 2] and [5, 5, 5]
    for _ in range(9):
        twin.append(0, [a, b], 1)
        twin.check(0, [a, b])
    assert fast_steps  # the shortest room decides how far the fast path goes


def test_fork_in_the_middle_never_writes_a_shared_page(fast_steps: list) -> None:
    twin = Twin()
    parent = twin.both("new_sequence")
    prefix = torch.cat([twin.append(0, [parent], 1) for _ in range(2)], 2)  # the second is a fast step
    assert len(fast_steps) == 1
    child = twin.both("fork", parent)
    pool, table = twin.store.pools[0], twin.store.tables[0]
    shared = table.pages[child, :, 0].clone()
    contents = [t[shared].clone() for t in (pool.keys, pool.values, pool.positions)]
    parent_step = twin.append(0, [parent], 1)  # its open pages are shared now: copied first
    assert len(fast_steps) == 1
    assert all(torch.equal(t[shared], c) for t, c in zip((pool.keys, pool.values, pool.positions), contents))
    twin.check(0, [parent])
    child_steps = [twin.append(0, [child], 1) for _ in range(3)]
    twin.check(0, [child])
    parent_read, child_read = twin.store.read(0, [parent]), twin.store.read(0, [child])
    assert torch.equal(parent_read.keys, torch.cat([prefix, parent_step], 2))
    assert torch.equal(child_read.keys, torch.cat([prefix, *child_steps], 2))
    for _ in range(6):  # then both together and each alone again
        twin.append(0, [parent, child], 1)
        twin.check(0, [parent, child])
        twin.append(0, [child], 1)
        twin.check(0, [child])
    assert torch.equal(twin.store.read(0, [parent, child]).keys[:, :, :2], torch.cat([prefix, prefix]))


def test_fork_of_a_sequence_outside_the_batch(fast_steps: list) -> None:
    twin = Twin()
    a, b, c = (twin.both("new_sequence") for _ in range(3))
    twin.append(0, [c], 3)
    twin.append(0, [a, b], 1)
    child = twin.both("fork", b)
    for _ in range(5):
        twin.append(0, [a, b], 1)
        twin.check(0, [a, b])
        twin.check(0, [child])


@pytest.mark.parametrize(
    "batches",
    [
        [[0, 1], [2]],  # disjoint
        [[0, 1], [1]],  # overlapping
        [[0, 1], [1, 0]],  # the same ids in another order
        [[3, 0], [0, 2, 1], [2, 3]],  # ids not consecutive
    ],
)
@pytest.mark.parametrize("run", [1, 3])
def test_batches_taking_turns_in_one_layer(fast_steps: list, batches: list, run: int) -> None:
    twin = Twin()
    for _ in range(4):
        twin.both("new_sequence")
    for _ in range(5):
        for batch in batches:
            for _ in range(run):
                twin.append(0, batch, 1)
                twin.check(0, batch)
    if run > 1:
        assert fast_steps


def test_work_on_another_layer_keeps_the_fast_path_correct(fast_steps: list) -> None:
    twin = Twin(layers=2)
    a, b = twin.both("new_sequence"), twin.both("new_sequence")
    twin.append(1, [a, b], 6)
    for i in range(8):
        twin.append(0, [a, b], 1)
        if i == 2:
            twin.both("compact", 1, [a, b], torch.tensor([[[0, 5], [1, 2]]] * 2))
        if i == 4:
            twin.both("truncate", 1, [b], 1)
        if i == 5:
            twin.append(1, [b, a], 2)
        twin.check(0, [a, b])
        twin.check(1, [a, b])
    assert len(fast_steps) >= 4


@pytest.mark.parametrize("batch", [[0, 1], [1]])
def test_compaction_in_the_middle(fast_steps: list, batch: list[int]) -> None:
    twin = Twin()
    a, b = twin.both("new_sequence"), twin.both("new_sequence")
    twin.append(0, [a, b], 5)
    twin.append(0, [a, b], 1)  # fast: open pages of [a, b] at slot 6
    keep = torch.tensor([[[0, 2, 5], [1, 3, 4]]] * len(batch))
    twin.both("compact", 0, batch, keep)  # the slots of [a, b]'s next tokens move
    for _ in range(7):
        twin.append(0, [a, b], 1)
        twin.check(0, [a, b])
    assert len(fast_steps) > 1


@pytest.mark.parametrize("batch", [[0, 1], [1]])
@pytest.mark.parametrize("length", [0, 2, 4, 5])
def test_truncation_in_the_middle(fast_steps: list, batch: list[int], length: int) -> None:
    twin = Twin()
    a, b = twin.both("new_sequence"), twin.both("new_sequence")
    twin.append(0, [a, b], 5)
    twin.append(0, [a, b], 1)
    twin.store.read(0, [a, b])
    twin.both("truncate", 0, batch, length)
    for _ in range(7):
        twin.append(0, [a, b], 1)
        twin.check(0, [a, b])


def test_explicit_positions_always_take_the_slow_path(fast_steps: list, store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1))
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1), torch.tensor([100]))
    assert fast_steps == []
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1))  # fast again, continuing the logical length
    store.append(0, [seq], step(1, 2, 1), step(1, 2, 1), torch.tensor([[7]]))
    assert len(fast_steps) == 1
    assert store.read(0, [seq]).positions.tolist() == [[[0, 100, 2, 7]] * 2]


def test_release_and_reuse_in_the_middle(fast_steps: list) -> None:
    twin = Twin()
    a, b, c = (twin.both("new_sequence") for _ in range(3))
    twin.append(0, [a, b], 1)
    twin.append(0, [a, b], 1)  # fast; the open pages of [a, b] keep room for 2 more tokens
    twin.both("release", [c])
    twin.append(0, [a, b], 1)
    twin.check(0, [a, b])
    twin.both("release", [b])
    reused = twin.both("new_sequence")
    assert reused == b
    for _ in range(6):
        twin.append(0, [a, b], 1)
        twin.check(0, [a, b])
    assert len(fast_steps) > 1


def test_fast_path_in_a_full_fixed_pool(fast_steps: list) -> None:
    store = PagedStore(StoreConfig(1, 2, 4, page_size=4, pages_per_layer=2, fixed_capacity=True))
    seq = store.new_sequence()
    keys = step(1, 2, 5)
    store.append(0, [seq], keys[:, :, :1], -keys[:, :, :1])
    store.append(0, [seq], keys[:, :, 1:3], -keys[:, :, 1:3])  # no free page left, but room in the open ones
    store.append(0, [seq], keys[:, :, 3:4], -keys[:, :, 3:4])
    assert len(fast_steps) == 2
    before = full_state(store)
    with pytest.raises(PoolExhaustedError):
        store.append(0, [seq], keys[:, :, 4:], -keys[:, :, 4:])
    assert_same(before, full_state(store))
    assert torch.equal(store.read(0, [seq]).keys, keys[:, :, :4])


def test_huge_truncate_lengths_and_bool_ids_are_rejected(store: PagedStore) -> None:
    seq = store.new_sequence()
    store.append(
        0,
        [seq],
        torch.zeros(1, store.tables[0].num_heads, 3, store.pools[0].head_dim),
        torch.zeros(1, store.tables[0].num_heads, 3, store.pools[0].value_dim),
    )
    with pytest.raises(ValueError, match=r"length must be an int in \[0, 2\*\*63\)"):
        store.truncate(0, [seq], 2**63)
    assert store.logical_lengths(0, [seq]).tolist() == [3]
    assert store.new_sequence() == 1
    with pytest.raises(ValueError, match="unknown or released"):
        store.read(0, [True])  # a bool is not a sequence id, though True == 1


def test_a_truncation_a_full_fixed_pool_cannot_serve_changes_nothing() -> None:
    from kvlib.codec import PageCodec, layer_shapes
    from kvlib.errors import PoolExhaustedError
    from kvlib.policies.quantization.int8 import Int8

    shapes = layer_shapes(1, 1, 4, 4, 4, torch.float32, torch.device("cpu"))
    codecs: list[PageCodec] = Int8().layer_codecs(shapes)
    store = PagedStore(StoreConfig(1, 1, 4, page_size=4, pages_per_layer=2, fixed_capacity=True, codecs=codecs))
    seq = store.new_sequence()
    store.append(0, [seq], torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4))
    assert store.seal(0, [seq]) == 2
    before = store.read(0, [seq])
    before = [t.clone() for t in before]
    with pytest.raises(PoolExhaustedError, match="reopen"):
        store.truncate(0, [seq], 7)  # the second sealed page would need an open copy: no page is free
    after = store.read(0, [seq])
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert store.physical_lengths(0, [seq]).tolist() == [[8]]
    store.truncate(0, [seq], 4)  # at a page boundary nothing needs reopening
    store.append(0, [seq], torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    assert store.physical_lengths(0, [seq]).tolist() == [[6]]


def test_a_store_used_under_inference_mode_can_be_changed_outside_it() -> None:
    store = PagedStore(StoreConfig(2, 2, 4, page_size=4))
    with torch.inference_mode():
        seq = store.new_sequence()
        for layer in range(2):
            store.append(layer, [seq], torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4))
            store.read(layer, [seq])
    store.append(0, [seq], torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # outside: no inference tensor to update
    store.compact(0, [seq], torch.tensor([[[0, 1, 9], [2, 3, 4]]]))
    store.release([seq])
    assert all(pool.pages_in_use == 0 for pool in store.pools)


def test_overwrite_rewrites_stored_tokens_and_refuses_shared_pages() -> None:
    store = PagedStore(StoreConfig(1, 2, 4, page_size=4))
    seq = store.new_sequence()
    keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    store.append(0, [seq], keys, values)
    new_keys, new_values = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    store.overwrite(0, [seq], torch.tensor([3, 7]), new_keys, new_values)
    read = store.read(0, [seq])
    keys[:, :, [3, 7]], values[:, :, [3, 7]] = new_keys, new_values
    assert torch.equal(read.keys, keys) and torch.equal(read.values, values)
    assert read.positions[0, 0].tolist() == list(range(10))
    store.fork(seq)
    with pytest.raises(ValueError, match="held by these sequences alone"):
        store.overwrite(0, [seq], torch.tensor([1]), new_keys[:, :, :1], new_values[:, :, :1])
    with pytest.raises(ValueError, match="name stored tokens"):
        store.overwrite(0, [seq], torch.tensor([10]), new_keys[:, :, :1], new_values[:, :, :1])


def test_read_mirror_follows_sequences_leaving_and_joining_the_batch() -> None:
    """The dense mirror drops released rows and gathers only joining ones; reads always equal a
    store without the mirror."""
    generator = torch.Generator().manual_seed(0)
    stores = [PagedStore(StoreConfig(2, 2, 4, page_size=4, read_cache=flag)) for flag in (True, False)]
    seqs = [[store.new_sequence() for _ in range(4)] for store in stores]

    def append(batch: list[int], tokens: int) -> None:
        keys = torch.randn(len(batch), 2, tokens, 4, generator=generator)
        values = torch.randn(len(batch), 2, tokens, 4, generator=generator)
        for store, ids in zip(stores, seqs):
            for layer in range(2):
                store.append(layer, [ids[i] for i in batch], keys, values)

    def same(batch: list[int]) -> None:
        for layer in range(2):
            mirrored, gathered = (store.read(layer, [ids[i] for i in batch]) for store, ids in zip(stores, seqs))
            for a, b in zip(mirrored, gathered):
                assert torch.equal(a, b)

    append([0, 1, 2], 5)
    append([3], 9)
    same([0, 1, 2])
    for store, ids in zip(stores, seqs):
        store.release([ids[1]])
    assert stores[0].read_caches[0].rows == (seqs[0][0], seqs[0][2])  # kept, without the released row
    append([0, 2], 1)
    same([0, 2])
    append([0, 2, 3], 1)  # the mirror extends its rows; sequence 3 joins at the read
    same([0, 2, 3])
    assert stores[0].read_caches[1].rows == (seqs[0][0], seqs[0][2], seqs[0][3])
    append([0, 2, 3], 3)
    same([0, 2, 3])


def dense_attention(query: torch.Tensor, read) -> torch.Tensor:
    """Float64 SDPA of ``query [batch, query_heads, 1, dim]`` over every valid slot of a dense
    read (a head with none gives zeros, as the page kernel does)."""
    group = query.shape[1] // read.keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (read.keys, read.values))
    scores = (query.double() @ keys.transpose(-1, -2)) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~read.valid.repeat_interleave(group, dim=1).unsqueeze(2), float("-inf"))
    return (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ values).float()


def filled_store(lengths: list[int], page_size: int, device_pages: int | None, seed: int) -> tuple[PagedStore, list[int]]:
    """A one-layer store (2 KV heads, head_dim 8) holding sequences of ``lengths`` tokens, appended
    in uneven steps (so a tiered store's earlier pages leave the device)."""
    generator = torch.Generator().manual_seed(seed)
    store = PagedStore(StoreConfig(1, 2, 8, page_size=page_size, key_summaries=True, device_pages=device_pages, read_cache=False))
    seqs = [store.new_sequence() for _ in lengths]
    for seq, length in zip(seqs, lengths):
        done = 0
        while done < length:
            tokens = min(length - done, 1 + done % 7)
            keys = torch.randn(1, 2, tokens, 8, generator=generator)
            store.append(0, [seq], keys, torch.randn(1, 2, tokens, 8, generator=generator))
            done += tokens
    return store, seqs


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    page_size=st.sampled_from([1, 4, 8]),
    device_pages=st.sampled_from([None, 2, 5]),
    k=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_attention_over_a_page_selection_equals_attention_over_its_dense_read(lengths, page_size, device_pages, k, seed) -> None:
    """A selection in any order (some heads choosing nothing, a partly filled last page anywhere
    in it) read in place through the page kernel gives what attention over its dense read gives;
    so does the whole layer, tiered or not."""
    store, seqs = filled_store(lengths, page_size, device_pages, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    used = store.tables[0].pages_used(store.physical_lengths(0, seqs))
    order = torch.rand(len(seqs), 2, int(used.max()), generator=generator).argsort(-1)[:, :, :k]
    chosen = torch.where(order < used.unsqueeze(-1), order, -1)
    query = torch.randn(len(seqs), 4, 1, 8, generator=generator)
    options = {"visible": None, "query_positions": torch.tensor([10**6]), "scale": 8**-0.5}
    selected = store.paged_selection(0, seqs, chosen).attend(query, **options)  # before the next hand-over restages
    torch.testing.assert_close(selected, dense_attention(query, store.read_selected(0, seqs, chosen)), atol=1e-5, rtol=1e-5)
    whole = store.paged_layer(0, seqs).attend(query, **options)
    torch.testing.assert_close(whole, dense_attention(query, store.read(0, seqs)), atol=1e-5, rtol=1e-5)


def test_a_tiered_layer_read_in_place_stages_only_its_off_device_pages() -> None:
    store, seqs = filled_store([30, 21], 4, 3, seed=7)
    pool = store.pools[0]
    tiers = (pool.pages_on_device, pool.pages_on_host, pool.device_row.clone(), pool.host_row.clone())
    host_reads = pool.host_pages_read
    paged = store.paged_layer(0, seqs)
    off_device = pool.pages_in_use - pool.pages_on_device
    assert off_device > 0 and pool.host_pages_read - host_reads == off_device
    assert pool.staged_bytes == off_device * pool.kv_page_bytes and store.peak_workspace >= pool.staged_bytes
    assert (pool.pages_on_device, pool.pages_on_host) == tiers[:2]  # nothing moved tier
    assert torch.equal(pool.device_row, tiers[2]) and torch.equal(pool.host_row, tiers[3])
    staged = paged.source.keys  # the staging arena (numpy), whose leading rows are the device rows
    assert staged.shape[0] >= pool.keys.shape[0] + off_device and staged.ctypes.data == pool.keys.data_ptr()
    query = torch.randn(2, 4, 1, 8)
    options = {"visible": None, "query_positions": torch.tensor([10**6]), "scale": 8**-0.5}
    torch.testing.assert_close(paged.attend(query, **options), dense_attention(query, store.read(0, seqs)), atol=1e-5, rtol=1e-5)
