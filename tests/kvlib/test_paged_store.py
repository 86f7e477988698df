"""Targeted tests of kvlib/paged_store.py: errors, capacity, positions, read cache, memory."""

from __future__ import annotations

import pytest
import torch

from kvlib import PagedStore, PoolExhaustedError


def step(batch: int, heads: int, tokens: int, dim: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, heads, tokens, dim, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def store() -> PagedStore:
    return PagedStore(2, 2, 4, page_size=4, pages_per_layer=2)


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
    store = PagedStore(1, 2, 4, read_cache=False)
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
    store = PagedStore(1, 2, 4, page_size=4, pages_per_layer=4, fixed_capacity=True)
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
    store = PagedStore(1, 1, 4, page_size=1, pages_per_layer=1, fixed_capacity=True)
    seq = store.new_sequence()
    before = snapshot(store)
    with pytest.raises(PoolExhaustedError):
        store.append(0, [seq], step(1, 1, 5), step(1, 1, 5))
    assert_same(before, snapshot(store))
    assert store.tables[0].pages.shape == (1, 1, 1)


def test_sharers_appending_together_copy_only_what_they_must() -> None:
    """A forked open page appended by both sharers in one batch needs one copy, not two."""
    store = PagedStore(1, 1, 4, page_size=4, pages_per_layer=2, fixed_capacity=True)
    parent = store.new_sequence()
    store.append(0, [parent], step(1, 1, 2), step(1, 1, 2))
    child = store.fork(parent)
    store.append(0, [parent, child], step(2, 1, 1, seed=1), step(2, 1, 1, seed=1))
    assert store.pools[0].pages_in_use == 2 and store.pools[0].refcount.tolist() == [1, 1]
    read = store.read(0, [parent, child])
    assert torch.equal(read.keys[:, :, 2], step(2, 1, 1, seed=1)[:, :, 0])
    assert torch.equal(read.keys[0, :, :2], read.keys[1, :, :2])


def test_per_layer_shapes() -> None:
    store = PagedStore(2, [1, 3], [2, 5], value_dim=[4, 1])
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


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"page_size": 0}, {"num_kv_heads": [1]}, {"head_dim": 0}])
def test_bad_store_arguments(bad: dict) -> None:
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
    args.update(bad)
    with pytest.raises(ValueError):
        PagedStore(**args)
