"""PagedStore.arrange: any permutation of each head's tokens, each keeping its position; page key
summaries follow; a tiered store keeps its page budget; bad orders are refused before any change."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, StoreConfig


def filled(lengths: list[int], device_pages: int | None, seed: int) -> tuple[PagedStore, int, torch.Tensor]:
    """One sequence, 2 heads of head_dim 4, page size 4, head ``h`` holding ``lengths[h]`` tokens."""
    store = PagedStore(StoreConfig(1, 2, 4, page_size=4, key_summaries=True, device_pages=device_pages, read_cache=False))
    seq = store.new_sequence()
    keys = torch.randn(1, 2, max(lengths), 4, generator=torch.Generator().manual_seed(seed))
    store.append(0, [seq], keys, keys + 1)
    keep = torch.tensor([[list(range(n)) + [-1] * (max(lengths) - n) for n in lengths]])
    store.compact(0, [seq], keep)
    return store, seq, keys


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 13), min_size=2, max_size=2),
    device_pages=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
def test_a_permutation_moves_every_token_with_its_position_and_the_summaries_follow(lengths, device_pages, seed) -> None:
    store, seq, keys = filled(lengths, device_pages, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    width = max(lengths)
    order = torch.full((1, 2, width), -1)
    for head, n in enumerate(lengths):
        order[0, head, :n] = torch.randperm(n, generator=generator)
    layout = store.arrange(0, [seq], order)
    assert torch.equal(layout, order)
    read = store.read(0, [seq])
    key_min, key_max, used = store.key_bounds(0, [seq])
    for head, n in enumerate(lengths):
        source = order[0, head, :n]
        assert torch.equal(read.keys[0, head, :n], keys[0, head, source])
        assert torch.equal(read.values[0, head, :n], keys[0, head, source] + 1)
        assert torch.equal(read.positions[0, head, :n], source)
        assert int(used[0, head]) == -(-n // 4)
        for page in range(int(used[0, head])):
            held = read.keys[0, head, page * 4 : min(n, page * 4 + 4)]
            assert torch.equal(key_min[0, head, page], held.amin(0)) and torch.equal(key_max[0, head, page], held.amax(0))
    if device_pages is not None:
        assert store.pools[0].pages_on_device <= 2 * device_pages


def test_the_identity_order_changes_nothing() -> None:
    store, seq, _ = filled([7, 5], None, 0)
    pages = store.tables[0].pages.clone()
    store.arrange(0, [seq], torch.tensor([[[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, -1, -1]]]))
    assert torch.equal(store.tables[0].pages, pages)


@pytest.mark.parametrize(
    "order, message",
    [
        ([[0, 1, 2, 3, 4, 5, -1], [0, 1, 2, 3, 4, -1, -1]], "permutation"),  # drops slot 6 of head 0
        ([[0, 1, 2, 3, 4, 5, 5], [0, 1, 2, 3, 4, -1, -1]], "repeat"),
        ([[0, 1, 2, 3, 4, 5, 6], [0, 1, -1, 2, 3, 4, -1]], "padding last"),
    ],
)
def test_an_order_that_is_not_a_permutation_is_refused_before_any_change(order, message) -> None:
    store, seq, _ = filled([7, 5], None, 0)
    before = store.read(0, [seq])
    with pytest.raises(ValueError, match=message):
        store.arrange(0, [seq], torch.tensor([order]))
    after = store.read(0, [seq])
    assert torch.equal(after.keys, before.keys) and torch.equal(after.positions, before.positions)
