"""Slot reuse (``PagedStore.compact(..., reuse_slots=True)``) against the in-order compaction:
the same tokens kept, with their keys, values and positions; pages freed and shared pages
untouched; the read mirror patched to what a fresh read gives."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, StoreConfig
from kvlib.storage.layers.slot_reuse import hole_fill

HEADS, DIM = 2, 3


def token_sets(store: PagedStore, seq: int) -> list[set[tuple]]:
    """Per head: the set of (position, key, value) it stores (a fresh gather, not the mirror)."""
    read = store.read(0, [seq], mirror=False)
    return [
        {
            (int(p), *k.tolist(), *v.tolist())
            for p, k, v, ok in zip(read.positions[0, h], read.keys[0, h], read.values[0, h], read.valid[0, h])
            if ok
        }
        for h in range(HEADS)
    ]


def filled_store(page_size: int, length: int, forked: bool) -> tuple[PagedStore, int, int | None]:
    store = PagedStore(StoreConfig(1, HEADS, DIM, page_size=page_size, pages_per_layer=2))
    seq = store.new_sequence()
    data = torch.arange(length * HEADS * DIM, dtype=torch.float32).view(1, HEADS, length, DIM)
    store.append(0, [seq], data, -data)
    other = store.fork(seq) if forked else None
    return store, seq, other


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.integers(1, 6),
    length=st.integers(1, 40),
    forked=st.booleans(),
    mirrored=st.booleans(),
    data=st.data(),
)
def test_slot_reuse_keeps_the_in_order_compactions_tokens(page_size, length, forked, mirrored, data):
    drops = []
    for _ in range(HEADS):
        few = st.sets(st.integers(0, length - 1), max_size=2)
        many = st.sets(st.integers(0, length - 1), max_size=length)
        drops.append(data.draw(st.one_of(few, many)))
    keep = torch.full((1, HEADS, length), -1, dtype=torch.int64)
    for h, gone in enumerate(drops):
        kept = [i for i in range(length) if i not in gone]
        keep[0, h, : len(kept)] = torch.tensor(kept, dtype=torch.int64)

    stores = []
    for reuse in (True, False):
        store, seq, other = filled_store(page_size, length, forked)
        if mirrored:
            store.read(0, [seq])
        shared_before = None if other is None else token_sets(store, other)
        layout = store.compact(0, [seq], keep, reuse_slots=reuse)
        if mirrored:  # the patched (or rebuilt) mirror reads what the pages hold
            assert all(torch.equal(a, b) for a, b in zip(store.read(0, [seq]), store.read(0, [seq], mirror=False)))
        if other is not None:
            assert token_sets(store, other) == shared_before  # a sharing sequence never sees the compaction
        pool = store.pools[0]
        referenced = store.tables[0].referenced_pages(torch.tensor([s for s in (seq, other) if s is not None]))
        assert torch.equal(pool.refcount[: pool.capacity].clone(), torch.bincount(referenced, minlength=pool.capacity))
        lengths = store.physical_lengths(0, [seq])[0]
        assert pool.pages_in_use == int(torch.unique(referenced).numel())
        assert lengths.tolist() == [length - len(gone) for gone in drops]
        for h in range(HEADS):
            assert sorted(j for j in layout[0, h].tolist() if j >= 0) == keep[0, h][keep[0, h] >= 0].tolist()
        stores.append((token_sets(store, seq), layout))
    (reused, reused_layout), (in_order, in_order_layout) = stores
    assert reused == in_order
    assert torch.equal(in_order_layout, keep)


def test_a_decode_step_eviction_moves_one_token_into_the_hole():
    store, seq, _ = filled_store(page_size=4, length=13, forked=False)
    pages = store.tables[0].pages[seq].clone()
    keep = torch.tensor([[[i for i in range(13) if i != 5] + [-1], list(range(12)) + [-1]]])
    layout = store.compact(0, [seq], keep, reuse_slots=True)
    assert layout[0, 0].tolist()[:12] == [0, 1, 2, 3, 4, 12, 6, 7, 8, 9, 10, 11]  # slot 5 takes the newest token
    assert layout[0, 1].tolist()[:12] == list(range(12))  # dropping the newest token moves nothing
    assert store.stored_positions(0, [seq])[0, 0].tolist() == [0, 1, 2, 3, 4, 12, 6, 7, 8, 9, 10, 11]
    kept_pages = store.tables[0].pages[seq]
    assert torch.equal(kept_pages[:, :3], pages[:, :3]) and bool((kept_pages[:, 3] == -1).all())  # no page rewritten, the last freed


def test_hole_fill_pairs_holes_with_later_kept_tokens():
    plan = hole_fill(np.array([[[0, 2, 4, 5, -1], [1, 2, 3, -1, -1]]]), np.array([[6, 4]]))
    assert plan.layout.tolist() == [[[0, 4, 2, 5, -1], [3, 1, 2, -1, -1]]]
    assert plan.moves.tolist() == [[2, 1]]
