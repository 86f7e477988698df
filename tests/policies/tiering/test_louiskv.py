"""``louiskv`` on tensors: a head retrieves (Quest's ``top_k`` for its query) only at the first step
after a prompt and when its query's similarity to its last retrieval's query falls below the
threshold; in between it reads its last retrieved pages and every page opened since; retrievals
are counted; a prompt or page counts that do not follow the last step start afresh; bad
parameters are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.tiering.louiskv import LouisKV, Retrieval, query_similarity
from kvlib.policies.tiering.quest import Quest


def summaries(heads: int, pages: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(1, heads, pages, dim, generator=generator)
    width = torch.rand(1, heads, pages, dim, generator=generator)
    return centre - width, centre + width


def step(policy: LouisKV, layer: int, query, key_min, key_max, used) -> torch.Tensor:
    assert policy.sparse(layer, 1)
    return policy.select_pages(layer, query, key_min, key_max, used)


def real(row: torch.Tensor) -> set[int]:
    return {int(p) for p in row if p >= 0}


@settings(max_examples=50, deadline=None)
@given(
    top_k=st.integers(1, 4),
    threshold=st.sampled_from([-1.0, 0.0, 0.5, 0.95, 1.0]),
    start=st.lists(st.integers(1, 8), min_size=2, max_size=2),
    growth=st.lists(st.lists(st.integers(0, 1), min_size=2, max_size=2), min_size=1, max_size=5),
    drift=st.floats(0.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_heads_retrieve_only_at_boundaries_and_reuse_their_pages_in_between(top_k, threshold, start, growth, drift, seed) -> None:
    policy = LouisKV(top_k=top_k, threshold=threshold, dense_layers=0)
    heads, group, dim = 2, 2, 4
    generator = torch.Generator().manual_seed(seed)
    used = torch.tensor([start])
    pages = max(start) + len(growth)
    base = torch.randn(1, heads * group, 1, dim, generator=generator)
    query = base
    key_min, key_max = summaries(heads, pages, dim, seed)
    first = step(policy, 1, query, key_min, key_max, used)
    own = Quest(top_k=top_k).select_pages(0, query, key_min, key_max, used)
    assert all(real(first[0, h]) == real(own[0, h]) for h in range(heads))  # the first step retrieves
    retrieved = {h: real(first[0, h]) for h in range(heads)}
    anchor, since = {h: query[0, h * group : (h + 1) * group, 0] for h in range(heads)}, used[0].clone()
    count = heads
    for grown in growth:
        used = used + torch.tensor([grown])
        query = base + drift * torch.randn(1, heads * group, 1, dim, generator=generator)
        key_min, key_max = summaries(heads, pages, dim, seed + int(used.sum()))  # the pages' keys change: a retrieval would tell
        read = step(policy, 1, query, key_min, key_max, used)
        fresh = Quest(top_k=top_k).select_pages(0, query, key_min, key_max, used)
        for h in range(heads):
            similarity = torch.nn.functional.cosine_similarity(query[0, h * group : (h + 1) * group, 0], anchor[h], dim=-1).min()
            if similarity < threshold:  # a boundary: this query's choice
                retrieved[h], anchor[h], since[h] = real(fresh[0, h]), query[0, h * group : (h + 1) * group, 0], used[0, h]
                count += 1
                assert real(read[0, h]) == retrieved[h]
            else:  # the last retrieval's pages and those opened since
                assert real(read[0, h]) == retrieved[h] | set(range(int(since[h]) - 1, int(used[0, h])))
            assert bool((read[0, h, len(real(read[0, h])) :] == -1).all())
        assert policy.retrievals[1] == count


def test_a_steady_query_keeps_its_pages_and_a_turn_retrieves() -> None:
    dim = 2
    key_min = torch.zeros(1, 1, 8, dim)
    key_max = torch.zeros(1, 1, 8, dim)
    key_max[0, 0, 1] = torch.tensor([4.0, 0.0])
    along_0, along_1 = torch.tensor([1.0, 0.0]).view(1, 1, 1, dim), torch.tensor([0.0, 1.0]).view(1, 1, 1, dim)
    policy = LouisKV(top_k=2, threshold=0.9, dense_layers=0)
    assert step(policy, 0, along_0, key_min, key_max, torch.tensor([[5]])).tolist() == [[[1, 4]]]
    key_max[0, 0, 3] = torch.tensor([9.0, 0.0])  # page 3 would now win, but the query has not moved
    assert step(policy, 0, along_0 * 2, key_min, key_max, torch.tensor([[6]])).tolist() == [[[1, 4, 5]]]  # + the page opened since
    assert policy.retrievals == {0: 1}
    key_max[0, 0, 2] = torch.tensor([0.0, 4.0])
    assert step(policy, 0, along_1, key_min, key_max, torch.tensor([[6]])).tolist() == [[[2, 5]]]  # a boundary: retrieved anew
    assert policy.retrievals == {0: 2}


def test_a_prompt_and_page_counts_that_do_not_follow_start_afresh() -> None:
    key_min, key_max = summaries(1, 8, 4, seed=3)
    query = torch.randn(1, 1, 1, 4, generator=torch.Generator().manual_seed(4))
    policy = LouisKV(top_k=2, threshold=-1.0, dense_layers=0)
    step(policy, 2, query, key_min, key_max, torch.tensor([[6]]))
    step(policy, 2, query, key_min, key_max, torch.tensor([[6]]))
    assert policy.retrievals == {2: 1}
    step(policy, 2, query, key_min, key_max, torch.tensor([[8]]))  # two pages more than the last step: not its successor
    assert policy.retrievals == {2: 2}
    assert not policy.arranges_tokens(2, 17) and 2 not in policy.last  # a prompt forgets the layer's retrievals
    step(policy, 2, query, key_min, key_max, torch.tensor([[8]]))
    assert policy.retrievals == {2: 3}


def test_a_retrieval_fits_the_next_step_only() -> None:
    made = Retrieval(torch.zeros(1, 4, 8), torch.zeros(1, 2, 2, dtype=torch.int64), torch.tensor([[3, 3]]), torch.tensor([[4, 7]]))
    assert made.fits(torch.zeros(1, 4, 8), torch.tensor([[5, 7]]))
    assert not made.fits(torch.zeros(1, 4, 8), torch.tensor([[6, 7]])) and not made.fits(torch.zeros(2, 4, 8), torch.tensor([[4, 7]]))


def test_a_group_drifts_when_any_of_its_query_heads_does() -> None:
    last = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])
    now = torch.tensor([[[1.0, 0.1], [0.0, 1.0], [0.0, 2.0], [0.1, 1.0]]])
    similarity = query_similarity(now, last, kv_heads=2)
    assert similarity[0, 0] == pytest.approx(0.0, abs=1e-6) and similarity[0, 1] > 0.99


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("louiskv(top_k=0)", "top_k must be >= 1"),
        ("louiskv(threshold=1.5)", r"threshold must be in \[-1, 1\]"),
        ("louiskv(threshold=-2)", r"threshold must be in \[-1, 1\]"),
        ("louiskv(dense_layers=-1)", "dense_layers must be >= 0"),
        ("louiskv(placement='quest')", "placement must be a device/host placement"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def test_registered_as_a_tiering_policy_and_its_spec_round_trips() -> None:
    assert "louiskv" in kvlib.available_policies()["tiering"]
    policy = kvlib.parse_policy("louiskv(top_k=4, placement='lru(device_mb=2.0)', threshold=0.8)")
    assert kvlib.parse_policy(policy.spec()) == policy
    assert policy.spec() == "louiskv(top_k=4, placement='lru(device_mb=2.0)', threshold=0.8)"


def test_the_pages_expected_next_are_what_a_step_without_a_boundary_reads() -> None:
    """``expected_pages``: what the layer read at its last step, which the next step reads again
    where no head reaches a boundary (the same query); None before the layer's first retrieval."""
    policy = LouisKV(top_k=2, threshold=0.5, dense_layers=0)
    key_min, key_max = summaries(2, 9, 4, seed=3)
    query = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(5))
    assert policy.expected_pages(1) is None
    used = torch.tensor([[6, 8]])
    step(policy, 1, query, key_min, key_max, used)
    expected = policy.expected_pages(1)
    assert policy.expected_pages(0) is None  # per layer
    assert torch.equal(step(policy, 1, query, key_min, key_max, used), expected)
