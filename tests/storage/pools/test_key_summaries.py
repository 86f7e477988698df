"""Key summaries (``storage/pools/key_summaries.py``): after any mix of appends (fast path included),
compactions, forks with copy-on-write, truncations (inside shared pages too) and releases, each
page's summary is the channel-wise min and max of the keys its referencing heads hold in it, with
pages split over device and host; free pages hold the empty summary. And Quest's page score is
an upper bound of the query's dot product with every key of the page."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from hypothesis.stateful import invariant

from kvlib.policies.tiering.quest import Quest
from tests.storage.store.test_store_state_machine import StoreMachine


class SummarizedStoreMachine(StoreMachine):
    """Every store rule on a tiered store (5 device pages per layer) that keeps key summaries."""

    tiered = True
    summarized = True

    @invariant()
    def summaries_are_the_min_and_max_of_held_keys(self) -> None:
        for layer, (pool, table) in enumerate(zip(self.store.pools, self.store.tables)):
            summaries = pool.summaries
            free = pool.refcount == 0
            assert bool((summaries.key_min[free] == float("inf")).all() and (summaries.key_max[free] == float("-inf")).all())
            checked = torch.zeros(pool.capacity, dtype=torch.bool)
            for seq in self.model:
                for head, length in enumerate(table.lengths[seq].tolist()):
                    for j in range(-(-length // self.page_size)):
                        page = int(table.pages[seq, head, j])
                        held = min(self.page_size, length - j * self.page_size)
                        keys = pool.read_pages(torch.tensor([page]))[0][0, :held]
                        assert torch.equal(summaries.key_min[page], keys.amin(0)), f"layer {layer} page {page}: min"
                        assert torch.equal(summaries.key_max[page], keys.amax(0)), f"layer {layer} page {page}: max"
                        checked[page] = True
            assert torch.equal(checked, ~free), "a page in use is referenced by no live head"


SummarizedStoreMachine.TestCase.settings = StoreMachine.TestCase.settings
TestSummarizedStoreMachine = SummarizedStoreMachine.TestCase


finite = st.floats(-100, 100, allow_nan=False, width=32)


@settings(max_examples=50, deadline=None)
@given(
    query=arrays("float32", (4, 1, 3), elements=finite),
    keys=arrays("float32", (2, 5, 3), elements=finite),
)
def test_quest_score_bounds_every_dot_product_of_the_page(query, keys) -> None:
    """4 query heads sharing 2 KV heads; one page of 5 keys per KV head."""
    query, keys = torch.from_numpy(query).unsqueeze(0), torch.from_numpy(keys).unsqueeze(0)  # [1, 4, 1, 3], [1, 2, 5, 3]
    bound = Quest().page_scores(query, keys.amin(2, keepdim=True), keys.amax(2, keepdim=True))  # [1, 2, 1]
    dots = torch.einsum("bhgd,bhtd->bhgt", query[:, :, 0].view(1, 2, 2, 3).double(), keys.double())
    scale = query.abs().sum(-1).view(1, 2, 2).amax(-1).double() * keys.abs().amax((2, 3)).double()
    assert bool((bound[..., 0].double() >= dots.amax((2, 3)) - 1e-5 * scale - 1e-6).all())  # float32 rounding


def test_the_store_reports_the_summaries_of_pages_in_use() -> None:
    from kvlib import PagedStore, StoreConfig

    store = PagedStore(StoreConfig(2, 2, 3, page_size=4, key_summaries=True, device_pages=2))
    seq = store.new_sequence()
    for layer in range(2):
        store.append(layer, [seq], torch.randn(1, 2, 10, 3), torch.randn(1, 2, 10, 3))
    pages = sum(pool.pages_in_use for pool in store.pools)
    assert pages == 2 * 2 * 3
    assert store.pools[0].summaries.page_bytes == 2 * 3 * 4
    assert store.memory_bytes()["key_summaries"] == pages * 2 * 3 * 4
    assert PagedStore(StoreConfig(1, 1, 3)).memory_bytes()["key_summaries"] == 0
