"""``leoam`` on tensors: the coarse-to-fine judgement on a hand-computed case (which chunks are
deserts at each level, which pages are fetched), a query head of a group keeping a chunk for the
group, a step reading fewer pages where the attention has deserts and never more than ``top_k``
(its newest always), everything read when nothing is a desert and ``top_k`` covers every page,
Quest's choice when chunks are single pages and nothing is a desert, the counters; bad parameters
are refused and the spec round-trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.tiering.leoam import LeoAM, chunk_abstracts
from kvlib.policies.tiering.quest import Quest


def points(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row, one KV head, pages of one key channel whose every key is ``values[p]``: the
    abstract of a chunk is then the smallest and largest value of its pages."""
    keys = torch.tensor(values).view(1, 1, -1, 1)
    return keys, keys.clone()


def step(policy: LeoAM, query, key_min, key_max, used, layer: int = 2) -> torch.Tensor:
    assert policy.sparse(layer, 1)
    return policy.select_pages(layer, query, key_min, key_max, used)


def real(row: torch.Tensor) -> list[int]:
    return [int(p) for p in row if p >= 0]


def summaries(heads: int, pages: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(1, heads, pages, dim, generator=generator)
    width = torch.rand(1, heads, pages, dim, generator=generator)
    return centre - width, centre + width


# Pages 0-7 and the newest, 8. With a query of 1 on one channel, a chunk's bound is its largest key.
HAND = [0.0, 5.0, 0.0, 0.0, 1.0, 1.0, 9.0, 8.0, 100.0]


def test_deserts_are_dropped_whole_coarse_to_fine_on_a_hand_computed_case() -> None:
    key_min, key_max = points(HAND)
    query, used = torch.ones(1, 1, 1, 1), torch.tensor([[9]])
    policy = LeoAM(top_k=4, chunk_pages=4, desert=3.0, dense_layers=0)
    _, _, levels = policy.judge(query, key_min, key_max, used)
    assert levels.sizes == [4, 2, 1]
    # chunks of 4 pages: [0-3] bound 5, [4-7] bound 9 (the newest page is read anyway, not judged): 5 < 9 - 3, a desert
    assert levels.kept[0].tolist() == [[[False, True, False]]]
    # the halves of [4-7]: [4-5] bound 1 (a desert), [6-7] bound 9
    assert levels.kept[1].tolist() == [[[False, False, False, True, False, False]]]
    # pages 6 and 7: 8 >= 9 - 3, both kept
    assert levels.kept[2][0, 0, :9].tolist() == [False] * 6 + [True, True, False]
    assert levels.scored == [2, 2, 2]
    # three of top_k - 1 = 3 places are used: the step reads 6, 7 and the newest, not page 1
    assert step(policy, query, key_min, key_max, used).tolist() == [[[6, 7, 8, -1]]]
    assert Quest(top_k=4).select_pages(0, query, key_min, key_max, used).tolist() == [[[1, 6, 7, 8]]]  # Quest reads page 1 too
    # a wider desert keeps [0-3]; inside it only page 1's half, then page 1: a run of two pages and one of one
    wider = LeoAM(top_k=9, chunk_pages=4, desert=4.5, dense_layers=0)
    _, _, levels = wider.judge(query, key_min, key_max, used)
    assert levels.kept[0].tolist() == [[[True, True, False]]]
    assert levels.kept[1].tolist() == [[[True, False, False, True, False, False]]]
    assert step(wider, query, key_min, key_max, used).tolist() == [[[1, 6, 7, 8, -1, -1, -1, -1, -1]]]


def test_top_k_caps_the_pages_read_best_first() -> None:
    key_min, key_max = points(HAND)
    policy = LeoAM(top_k=2, chunk_pages=4, desert=3.0, dense_layers=0)
    assert step(policy, torch.ones(1, 1, 1, 1), key_min, key_max, torch.tensor([[9]])).tolist() == [[[6, 8]]]


def test_a_query_head_keeps_a_chunk_for_its_group() -> None:
    """Two query heads share the KV head: one scores along +1 (page 6 best), the other along -1
    (page 2, value -7, best): each keeps its own chunk, so the group reads both."""
    values = [0.0, 0.0, -7.0, 0.0, 1.0, 1.0, 9.0, 0.0, 0.0]
    key_min, key_max = points(values)
    query = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    policy = LeoAM(top_k=4, chunk_pages=4, desert=3.0, dense_layers=0)
    assert step(policy, query, key_min, key_max, torch.tensor([[9]])).tolist() == [[[2, 6, 8, -1]]]
    alone = LeoAM(top_k=4, chunk_pages=4, desert=3.0, dense_layers=0)
    assert step(alone, query[:, :1], key_min, key_max, torch.tensor([[9]])).tolist() == [[[6, 8, -1, -1]]]


def test_chunk_abstracts_span_their_alive_pages() -> None:
    key_min, key_max = summaries(2, 8, 3, seed=4)
    alive = torch.tensor([True, False, True, True, False, False, False, False]).expand(1, 2, 8)
    low, high, live = chunk_abstracts(key_min, key_max, alive, 4)
    assert live.tolist() == [[[True, False], [True, False]]]
    assert torch.equal(low[:, :, 0], key_min[:, :, [0, 2, 3]].amin(2)) and torch.equal(high[:, :, 0], key_max[:, :, [0, 2, 3]].amax(2))
    assert bool((low[:, :, 1] == 0).all()) and bool((high[:, :, 1] == 0).all())


@settings(max_examples=60, deadline=None)
@given(
    top_k=st.integers(1, 6),
    chunk_pages=st.sampled_from([1, 2, 4, 8]),
    desert=st.sampled_from([0.1, 1.0, 4.0]),
    used=st.lists(st.integers(1, 13), min_size=2, max_size=2),
    group=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_a_step_reads_its_newest_and_at_most_top_k_surviving_pages(top_k, chunk_pages, desert, used, group, seed) -> None:
    heads, dim = 2, 4
    key_min, key_max = summaries(heads, max(used), dim, seed)
    query = torch.randn(1, heads * group, 1, dim, generator=torch.Generator().manual_seed(seed + 1))
    pages_used = torch.tensor([used])
    policy = LeoAM(top_k=top_k, chunk_pages=chunk_pages, desert=desert, dense_layers=0)
    read = step(policy, query, key_min, key_max, pages_used)
    _, _, levels = policy.judge(query, key_min, key_max, pages_used)
    survivors = levels.kept[-1][0, :, : max(used)]
    for head in range(heads):
        pages = real(read[0, head])
        assert pages == sorted(set(pages)) and len(pages) <= top_k
        assert used[head] - 1 in pages  # the newest
        assert all(bool(survivors[head, p]) for p in pages if p != used[head] - 1)  # no page of a desert
        assert len(pages) == min(top_k, 1 + int(survivors[head].sum()))  # the best survivors fill what top_k allows
    assert policy.fetched == {2: int((read >= 0).sum())} and policy.steps == {2: 1}
    assert policy.judged[2] == sum(levels.scored)


@settings(max_examples=30, deadline=None)
@given(used=st.lists(st.integers(1, 12), min_size=2, max_size=2), seed=st.integers(0, 2**16))
def test_without_deserts_every_page_or_quests_choice_is_read(used, seed) -> None:
    key_min, key_max = summaries(2, max(used), 4, seed)
    query = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(seed + 1))
    pages_used = torch.tensor([used])
    everything = step(LeoAM(top_k=12, desert=1e6, dense_layers=0), query, key_min, key_max, pages_used)
    for head in range(2):
        assert real(everything[0, head]) == list(range(used[head]))
    single = step(LeoAM(top_k=3, chunk_pages=1, desert=1e6, dense_layers=0), query, key_min, key_max, pages_used)
    quest = Quest(top_k=3).select_pages(0, query, key_min, key_max, pages_used)
    for head in range(2):
        assert real(single[0, head]) == real(quest[0, head])


def test_dense_layers_and_multi_token_calls_read_every_page() -> None:
    policy = LeoAM(dense_layers=2)
    assert policy.sparse(2, 1) and not policy.sparse(1, 1) and not policy.sparse(2, 4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("leoam(top_k=0)", "top_k must be >= 1"),
        ("leoam(chunk_pages=3)", "chunk_pages must be a power of two >= 1"),
        ("leoam(chunk_pages=0)", "chunk_pages must be a power of two >= 1"),
        ("leoam(desert=0)", "desert must be > 0"),
        ("leoam(dense_layers=-1)", "dense_layers must be >= 0"),
        ("leoam(placement='quest')", "placement must be a device/host placement"),
        ("leoam(chunks=4)", "chunks"),
    ],
)
def test_bad_parameters_are_refused_in_one_line(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        kvlib.parse_policy(spec)
    assert "\n" not in str(error.value)


def test_registered_as_a_tiering_policy_and_its_spec_round_trips() -> None:
    assert "leoam" in kvlib.available_policies()["tiering"]
    spec = "leoam(top_k=4, dense_layers=1, placement='lru(device_mb=2.0, host_mb=8.0)', chunk_pages=4, desert=2.5)"
    policy = kvlib.parse_policy(spec)
    assert kvlib.parse_policy(policy.spec()) == policy
    assert policy.spec() == spec
    composed = kvlib.parse_spec("kivi(bits=4)+leoam(top_k=4)")  # composes with a codec
    assert str(composed) == "kivi(bits=4)+leoam(top_k=4)" and composed.tiering == LeoAM(top_k=4)
