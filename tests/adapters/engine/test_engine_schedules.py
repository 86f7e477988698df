"""A hypothesis test of the Engine over random arrival schedules, token and page budgets, page
sizes, preemption modes and prefix caching: every request finishes with the output it would have
alone, page references always match the holders (live sequences and the prefix index), the
fixed pools never grow, a request holds only prefix index entries whose pages its sequence reads,
and nothing is left once the index lets go."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvlib
from tests.adapters.conftest import build_model

NEW = 4
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def case() -> tuple[torch.nn.Module, list[list[int]], list[list[int]]]:
    model = build_model("llama")
    generator = torch.Generator().manual_seed(5)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 97, (n,), generator=generator).tolist()

    system, document = draw(24), draw(20)
    prompts = [system + draw(7), system + draw(30), draw(11), system + document + draw(2), system + document + draw(9), draw(1), draw(40)]
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())
    return model, prompts, expected


def references_match_holders(engine: kvlib.Engine) -> None:
    """Every page's reference count is the number of table entries and index entries naming it."""
    store = engine.store
    rows = torch.tensor(store.sequences, dtype=torch.int64)
    for layer, (pool, table) in enumerate(zip(store.pools, store.tables)):
        named = [table.referenced_pages(rows)] if len(rows) else []
        if engine.prefix is not None:
            named += [entry.pages[1][layer].flatten() for entry in engine.prefix.index.entries.values()]
        ids = torch.cat(named) if named else torch.zeros(0, dtype=torch.int64)
        counts = torch.bincount(ids, minlength=pool.capacity)
        assert torch.equal(counts, pool.refcount[: pool.capacity].to(counts.dtype)), f"layer {layer}"


def holders_read_their_entries(engine: kvlib.Engine) -> None:
    """Every prefix index entry a running request holds names pages of its own sequence: a
    request never pins a second copy of a block (so alone, it fits in a budget sized for it)."""
    store = engine.store
    for request in engine.scheduler.running:
        for layer, table in enumerate(store.tables):
            own = table.referenced_pages(torch.tensor([request.seq]))
            for entry in request.entries:
                assert bool(torch.isin(entry.pages[1][layer].flatten(), own).all()), f"request {request.request_id}, layer {layer}"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12)), min_size=1, max_size=7),
    max_batch_tokens=st.integers(2, 64),
    page_size=st.sampled_from([4, 8, 16]),
    spare_pages=st.integers(0, 24),
    preemption=st.sampled_from(["swap", "recompute"]),
    prefix_cache=st.booleans(),
    reserve_pages=st.integers(0, 2),
)
# a livelock: a request that recomputed blocks the index still held on other pages pinned both
# copies, so alone it could neither grow nor reclaim anything (the swapped request waited behind it)
@example(
    arrivals=[(0, 0), (0, 0), (0, 0), (4, 0), (0, 0), (0, 11), (0, 0)],
    max_batch_tokens=41,
    page_size=4,
    spare_pages=0,
    preemption="swap",
    prefix_cache=True,
    reserve_pages=0,
)
def test_random_schedules_finish_exactly_without_leaks(
    case, arrivals, max_batch_tokens, page_size, spare_pages, preemption, prefix_cache, reserve_pages
) -> None:
    model, prompts, expected = case
    kv_heads, layers, head_dim = 2, 2, 8
    largest = max(len(prompts[index]) for index, _ in arrivals) + NEW
    pages = kv_heads * math.ceil(largest / page_size) + reserve_pages + spare_pages
    page_bytes = layers * page_size * 2 * head_dim * 4
    engine = kvlib.Engine(
        model,
        max_batch_tokens=max_batch_tokens,
        page_size=page_size,
        page_budget_bytes=pages * page_bytes,
        preemption=preemption,
        prefix_cache=prefix_cache,
        reserve_pages=reserve_pages,
    )
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][1])
    ids: dict[int, int] = {}
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0][1][1] <= step:
            order, (index, _) = pending.pop(0)
            ids[order] = engine.add_request(prompts[index], max_new_tokens=NEW)
        engine.step()
        references_match_holders(engine)
        holders_read_their_entries(engine)
        assert all(pool.capacity == pages for pool in engine.store.pools)
        step += 1
        assert step < MAX_STEPS, "the engine stopped making progress"
    for order, (index, _) in enumerate(arrivals):
        assert engine.requests[ids[order]].output == expected[index]
    if engine.prefix is not None:
        engine.prefix.index.clear()
    assert sum(pool.pages_in_use for pool in engine.store.pools) == 0
