"""``specache`` on tensors: each decode step reads the pages the same layer's previous step chose
(its newest page added) and chooses, with its own query, what the next step reads (Quest's rating
of the 1-bit key grid); the first step after a prompt reads its own choice; a prompt, other page
counts or another layer never reuse a choice; bad parameters are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.tiering.quest import Quest
from kvlib.policies.tiering.specache import SpeCache, SpeculatedPages


def summaries(heads: int, pages: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(1, heads, pages, dim, generator=generator)
    width = torch.rand(1, heads, pages, dim, generator=generator)
    return centre - width, centre + width


def step(policy: SpeCache, layer: int, query, key_min, key_max, used) -> torch.Tensor:
    """One sparse decode step of ``layer`` as the cache makes it: ``sparse`` (checked), then ``select_pages``."""
    assert policy.sparse(layer, 1)
    return policy.select_pages(layer, query, key_min, key_max, used)


def real(row: torch.Tensor) -> list[int]:
    return [int(p) for p in row if p >= 0]


@settings(max_examples=50, deadline=None)
@given(
    top_k=st.integers(1, 5),
    start=st.lists(st.integers(1, 9), min_size=2, max_size=2),
    growth=st.lists(st.lists(st.integers(0, 1), min_size=2, max_size=2), min_size=1, max_size=4),
    group=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_each_step_reads_what_the_previous_step_chose_and_its_newest_page(top_k, start, growth, group, seed) -> None:
    policy = SpeCache(top_k=top_k, dense_layers=0)
    heads, dim = 2, 4
    used = torch.tensor([start])
    key_min, key_max = summaries(heads, max(start) + len(growth), dim, seed)
    queries = torch.randn(len(growth) + 1, 1, heads * group, 1, dim, generator=torch.Generator().manual_seed(seed + 1))
    first = step(policy, 3, queries[0], key_min, key_max, used)
    assert torch.equal(first, Quest(top_k=top_k).select_pages(0, queries[0], key_min, key_max, used))  # nothing speculated yet
    chosen = first
    for query, grown in zip(queries[1:], growth):
        used = used + torch.tensor([grown])
        read = step(policy, 3, query, key_min, key_max, used)
        for head in range(heads):
            expected = sorted(set(real(chosen[0, head])) | {int(used[0, head]) - 1})
            assert real(read[0, head]) == expected
            assert bool((read[0, head, len(expected) :] == -1).all())
        chosen = Quest(top_k=top_k).select_pages(0, query, key_min, key_max, used)
        assert torch.equal(policy.speculated[3].chosen, chosen)  # what the next step reads


def test_the_query_of_one_step_decides_the_pages_of_the_next() -> None:
    dim = 2
    key_min = torch.zeros(1, 1, 6, dim)
    key_max = torch.zeros(1, 1, 6, dim)
    key_max[0, 0, 1] = torch.tensor([4.0, 0.0])  # page 1 answers a query along channel 0
    key_max[0, 0, 3] = torch.tensor([0.0, 4.0])  # page 3 one along channel 1
    along_0, along_1 = torch.tensor([1.0, 0.0]).view(1, 1, 1, dim), torch.tensor([0.0, 1.0]).view(1, 1, 1, dim)
    policy = SpeCache(top_k=2, dense_layers=0)
    used = torch.tensor([[5]])
    assert step(policy, 0, along_0, key_min, key_max, used).tolist() == [[[1, 4]]]  # its own choice: page 1 and the newest
    assert step(policy, 0, along_1, key_min, key_max, used).tolist() == [[[1, 4]]]  # the previous step's choice
    assert step(policy, 0, along_1, key_min, key_max, used + 1).tolist() == [[[3, 4, 5]]]  # page 3, chosen before; new page 5


def test_a_prompt_other_page_counts_and_other_layers_start_afresh() -> None:
    key_min, key_max = summaries(2, 8, 4, seed=1)
    query = torch.randn(1, 2, 1, 4, generator=torch.Generator().manual_seed(2))
    policy = SpeCache(top_k=2, dense_layers=0)
    own = Quest(top_k=2).select_pages(0, query, key_min, key_max, torch.tensor([[6, 6]]))
    step(policy, 2, -query, key_min, key_max, torch.tensor([[6, 6]]))
    assert torch.equal(step(policy, 3, query, key_min, key_max, torch.tensor([[6, 6]])), own)  # layer 3 chose nothing yet
    assert not policy.arranges_tokens(2, 40)  # a prompt in layer 2: its speculated pages go
    assert 2 not in policy.speculated and 3 in policy.speculated
    assert torch.equal(step(policy, 2, query, key_min, key_max, torch.tensor([[6, 6]])), own)
    assert torch.equal(
        step(policy, 3, query, key_min, key_max, torch.tensor([[3, 6]])),
        Quest(top_k=2).select_pages(0, query, key_min, key_max, torch.tensor([[3, 6]])),
    )


def test_a_choice_fits_the_next_step_only() -> None:
    made = SpeculatedPages(torch.zeros(1, 2, 2, dtype=torch.int64), torch.tensor([[4, 7]]))
    assert made.fits(torch.tensor([[4, 8]])) and made.fits(torch.tensor([[5, 8]]))
    assert not made.fits(torch.tensor([[6, 8]])) and not made.fits(torch.tensor([[3, 7]])) and not made.fits(torch.tensor([[4, 7, 1]]))


def test_dense_layers_and_multi_token_calls_read_every_page() -> None:
    policy = SpeCache(dense_layers=2)
    assert policy.sparse(2, 1) and not policy.sparse(1, 1) and not policy.sparse(2, 4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("specache(top_k=0)", "top_k must be >= 1"),
        ("specache(dense_layers=-1)", "dense_layers must be >= 0"),
        ("specache(placement='quest')", "placement must be a device/host placement"),
        ("specache(bits=1)", "bits"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def test_registered_as_a_tiering_policy_and_its_spec_round_trips() -> None:
    assert "specache" in kvlib.available_policies()["tiering"]
    spec = "specache(top_k=4, dense_layers=1, placement='lru(device_mb=2.0, host_mb=8.0)')"
    policy = kvlib.parse_policy(spec)
    assert kvlib.parse_policy(policy.spec()) == policy
    assert policy.spec() == "specache(top_k=4, dense_layers=1, placement='lru(device_mb=2.0, host_mb=8.0)')"
