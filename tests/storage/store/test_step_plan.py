"""Tests of storage/store/step_plan.py (through PagedStore.plan_step and the pools' write_planned / attend_planned):
a planned decode step stores what appends store, a ring keeps what dropping the oldest token
and appending keeps, and planned attention is the paged kernel's over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, StoreConfig
from kvlib.kernels.paged_attention import paged_attention
from kvlib.storage.store.step_plan import Ring

DIM = 4


def tokens(batch: int, heads: int, count: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, heads, count, DIM, generator=torch.Generator().manual_seed(seed))


def by_position(store: PagedStore, layer: int, rows: list[int]) -> list[dict[int, tuple]]:
    """Each (row, head)'s stored tokens as {position: (key, value)} (slot order aside)."""
    read = store.read(layer, rows, mirror=False)
    held = []
    for b in range(len(rows)):
        for h in range(read.valid.shape[1]):
            held.append(
                {
                    int(p): (tuple(k.tolist()), tuple(v.tolist()))
                    for p, k, v, ok in zip(read.positions[b, h], read.keys[b, h], read.values[b, h], read.valid[b, h])
                    if ok
                }
            )
    return held


def assert_consistent(store: PagedStore) -> None:
    """Every page's reference count is the number of block-table entries naming it."""
    for pool, table in zip(store.pools, store.tables):
        counts = torch.zeros(pool.capacity, dtype=torch.int64)
        named = (
            table.referenced_pages(torch.tensor(store.sequences, dtype=torch.int64))
            if store.sequences
            else torch.zeros(0, dtype=torch.int64)
        )
        counts.index_add_(0, named, torch.ones_like(named))
        assert torch.equal(counts, pool.refcount)
        used = table.pages_used(table.lengths)
        assert bool(((table.pages >= 0).sum(-1) == used).all())


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    page_size=st.sampled_from([1, 2, 4]),
    prompts=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    drops=st.lists(st.integers(0, 3), min_size=1, max_size=9),
    steps=st.lists(st.integers(1, 3), min_size=1, max_size=10),
    fork_at=st.integers(-1, 9),
    seed=st.integers(0, 2**16),
)
def test_planned_steps_store_what_appends_store(layers, heads, page_size, prompts, drops, steps, fork_at, seed) -> None:
    """Whatever the heads hold (a prompt, some of it dropped per head), and with rows forked (shared
    pages, copy-on-write) between steps, planned steps leave every row, head and page exactly as
    appending the same tokens does."""
    stores = [PagedStore(StoreConfig(layers, heads, DIM, page_size=page_size, pages_per_layer=2, read_cache=False)) for _ in range(2)]
    rows = []
    for store in stores:
        rows = [store.new_sequence() for _ in prompts]
        for b, (row, length) in enumerate(zip(rows, prompts)):
            for layer in range(layers):
                store.append(layer, [row], tokens(1, heads, length, seed + b), tokens(1, heads, length, seed + b + 1))
                keep = torch.stack([torch.arange(length).roll(h) for h in range(heads)])[None]
                cut = min(drops[(b + layer) % len(drops)], length - 1)
                store.compact(layer, [row], torch.where(keep < length - cut, keep, -1))
    planned, appended = stores
    for i, count in enumerate(steps):
        if i == fork_at:  # the first row stays live beside its fork: their pages are shared
            forks = [store.fork(rows[0]) for store in stores]
            assert forks[0] == forks[1]
            rows = [*rows[1:], forks[0]]
        keys, values = tokens(len(rows), heads, count, seed + 100 + i), tokens(len(rows), heads, count, seed + 200 + i)
        logical = planned.logical_lengths(0, rows)
        plan = planned.plan_step(rows, count)
        assert plan is not None
        for layer in range(layers):
            plan.pools[layer].format.write_planned(plan, layer, keys, values)
            appended.append(layer, rows, keys, values, logical.unsqueeze(-1) + torch.arange(count))
    for layer in range(layers):
        assert by_position(planned, layer, rows) == by_position(appended, layer, rows)
        assert torch.equal(planned.physical_lengths(layer, rows), appended.physical_lengths(layer, rows))
        assert torch.equal(planned.logical_lengths(layer, rows), appended.logical_lengths(layer, rows))
    assert_consistent(planned)
    assert planned.memory_bytes()["pages"] == appended.memory_bytes()["pages"]


@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 2),
    page_size=st.sampled_from([2, 4]),
    start=st.integers(0, 3),
    window=st.integers(2, 9),
    prompt=st.integers(1, 16),
    steps=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_a_ring_keeps_the_first_tokens_and_the_newest(heads, page_size, start, window, prompt, steps, seed) -> None:
    """A ring of ``cap = start + window`` slots: once a head holds its cap, each planned token takes
    the slot of its oldest token past the first ``start``; it then holds the ``start`` earliest
    tokens and the ``window`` newest, each with its own key and value."""
    cap = start + window
    store = PagedStore(StoreConfig(2, heads, DIM, page_size=page_size, pages_per_layer=2, read_cache=False))
    row = store.new_sequence()
    ring = Ring(np.full((2, 1, heads), cap, dtype=np.int64), start)
    sent: dict[int, tuple] = {}
    for layer in range(2):
        store.append(layer, [row], tokens(1, heads, prompt, seed), tokens(1, heads, prompt, seed + 1))
        if prompt > cap:  # a prompt compacted to the cap: its first and last tokens
            keep = torch.tensor([*range(start), *range(prompt - window, prompt)]).expand(1, heads, cap)
            store.compact(layer, [row], keep)
    for i in range(steps):
        keys, values = tokens(1, heads, 1, seed + 10 + i), tokens(1, heads, 1, seed + 50 + i)
        plan = store.plan_step([row], 1, ring)
        assert plan is not None
        for layer in range(2):
            plan.pools[layer].format.write_planned(plan, layer, keys, values)
        sent[prompt + i] = (keys, values)
    seen = prompt + steps
    expected = sorted(set(range(min(start, seen))) | set(range(max(seen - window, 0), seen)) if seen > cap else range(seen))
    for layer in range(2):
        assert store.logical_lengths(layer, [row]).tolist() == [seen]
        held = by_position(store, layer, [row])
        for h in range(heads):
            assert sorted(held[h]) == list(expected)
            for position in expected:
                if position in sent:
                    assert held[h][position] == (tuple(sent[position][0][0, h, 0].tolist()), tuple(sent[position][1][0, h, 0].tolist()))
    assert_consistent(store)


def test_planned_attention_is_the_paged_kernel_over_the_same_tokens() -> None:
    """A pool's attend_planned gives paged_attention's output over the layer as stored, in transformers'
    layout ``[batch, queries, query_heads, dim]``, causal by the new tokens' positions or by a mask."""
    store = PagedStore(StoreConfig(2, 2, DIM, page_size=4, pages_per_layer=2, read_cache=False))
    rows = [store.new_sequence(), store.new_sequence()]
    for layer in range(2):
        store.append(layer, rows, tokens(2, 2, 6, layer), tokens(2, 2, 6, layer + 5))
    plan = store.plan_step(rows, 2)
    for layer in range(2):
        plan.pools[layer].format.write_planned(plan, layer, tokens(2, 2, 2, 20 + layer), tokens(2, 2, 2, 30 + layer))
    query = torch.randn(2, 4, 2, DIM, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 1, 2, 8, dtype=torch.bool).tril(diagonal=6)
    mask[1, :, :, :2] = False  # a row whose first tokens are padding
    for layer in range(2):
        pool, table = store.pools[layer], store.tables[layer]
        rows_t = torch.tensor(rows)
        for given_mask, visible, causal in ((None, None, torch.tensor([6, 7])), (mask, mask[:, 0], None)):
            expected = paged_attention(
                query,
                pool.keys,
                pool.values,
                pool.positions,
                table.pages[rows_t],
                table.lengths[rows_t],
                visible=visible,
                query_positions=causal,
                scale=0.5,
            )
            got = plan.pools[layer].format.attend_planned(plan, layer, query, given_mask, 0.5)
            torch.testing.assert_close(got, expected.transpose(1, 2))


@pytest.mark.parametrize(
    "config",
    [
        {"read_cache": True},
        {"read_cache": False, "device_pages": 4},
        {"read_cache": False, "key_summaries": True},
    ],
    ids=["read-mirror", "tiered", "key-summaries"],
)
def test_no_plan_where_pages_take_no_planned_writes(config: dict) -> None:
    """A read mirror, a tiered pool and key summaries keep state per write: no plan (the caller
    appends layer by layer), and nothing changes."""
    store = PagedStore(StoreConfig(1, 1, DIM, page_size=4, pages_per_layer=8, **config))
    row = store.new_sequence()
    store.append(0, [row], tokens(1, 1, 3, 0), tokens(1, 1, 3, 1))
    before = store.tables[0].pages.clone(), store.pools[0].refcount.clone()
    assert store.plan_step([row], 1) is None
    assert torch.equal(store.tables[0].pages, before[0]) and torch.equal(store.pools[0].refcount, before[1])


def test_any_other_change_drops_the_layout() -> None:
    """A compaction between steps makes the next step plan again from the tables (a write where
    the old layout said would land in a freed page)."""
    store = PagedStore(StoreConfig(1, 1, DIM, page_size=4, pages_per_layer=2, read_cache=False))
    row = store.new_sequence()
    store.append(0, [row], tokens(1, 1, 6, 0), tokens(1, 1, 6, 1))
    plan = store.plan_step([row], 1)
    plan.pools[0].format.write_planned(plan, 0, tokens(1, 1, 1, 2), tokens(1, 1, 1, 3))
    store.compact(0, [row], torch.tensor([[[0, 1, -1, -1, -1, -1, -1]]]))
    plan = store.plan_step([row], 1)
    plan.pools[0].format.write_planned(plan, 0, tokens(1, 1, 1, 4), tokens(1, 1, 1, 5))
    assert store.read(0, [row]).positions[0, 0].tolist() == [0, 1, 7]
    assert_consistent(store)


def test_a_page_of_steps_is_laid_out_once(monkeypatch) -> None:
    """Where each step's token goes is worked out once a page of steps (the bookkeeping a decode
    step saves): planning must not drop the layout it just built."""
    import kvlib.storage.store.paged_store as paged_store

    build, built = paged_store.build_layout, []
    monkeypatch.setattr(paged_store, "build_layout", lambda *args: built.append(args) or build(*args))
    store = PagedStore(StoreConfig(2, 1, DIM, page_size=4, pages_per_layer=4, read_cache=False))
    row = store.new_sequence()
    for layer in range(2):
        store.append(layer, [row], tokens(1, 1, 4, layer), tokens(1, 1, 4, layer + 2))
    for step in range(4):
        plan = store.plan_step([row], 1)
        for layer in range(2):
            plan.pools[layer].format.write_planned(plan, layer, tokens(1, 1, 1, 10 + step), tokens(1, 1, 1, 20 + step))
    assert len(built) == 1
    assert_consistent(store)
