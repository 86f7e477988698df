"""``clusterkv`` on tensors: its k-means against a loop reference, its arrangement (each head's
clusters one after another, positions ascending inside), page scores against a loop reference,
page choice (newest always, every page when they cover the head); bad parameters refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.policies.tiering.clusterkv import ClusterKV
from kvlib.policy import LayerView


def kmeans_reference(keys: torch.Tensor, clusters: int, iterations: int) -> list[int]:
    """Spherical k-means of one head's keys ``[n, dim]`` written out with loops (float64): the
    unit directions; initial centroids at rows ``j * n // clusters``; each round every key goes to
    the centroid of highest cosine (first on ties), each non-empty cluster's centroid becomes its
    members' normalised mean; a last assignment."""
    directions = [k / k.norm() for k in keys.double()]
    n = len(directions)
    centroids = [directions[j * n // clusters].clone() for j in range(clusters)]

    def assign() -> list[int]:
        return [max(range(clusters), key=lambda c: (float(d @ centroids[c]), -c)) for d in directions]

    for _ in range(iterations):
        members = assign()
        for c in range(clusters):
            mine = [d for d, m in zip(directions, members) if m == c]
            if mine:
                total = sum(mine)
                centroids[c] = total / total.norm()
    return assign()


def blobs(heads: int, per_cluster: int, clusters: int, dim: int, seed: int) -> torch.Tensor:
    """``[1, heads, clusters * per_cluster, dim]`` keys around ``clusters`` far-apart directions,
    interleaved (token ``t`` belongs to blob ``t % clusters``)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(heads, clusters, dim, generator=generator), dim=-1) * 5
    noise = torch.randn(heads, clusters * per_cluster, dim, generator=generator) * 0.3
    return (centres.repeat(1, per_cluster, 1) + noise).unsqueeze(0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clusters_match_the_loop_reference(seed: int) -> None:
    keys = blobs(heads=2, per_cluster=6, clusters=4, dim=8, seed=seed)
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    policy = ClusterKV(cluster_tokens=6, iterations=5)
    ids = policy.cluster_ids(keys, torch.arange(keys.shape[2]).expand(valid.shape), valid)
    for head in range(2):
        assert ids[0, head].tolist() == kmeans_reference(keys[0, head], 4, 5)


def test_separated_blobs_are_found_whatever_their_order() -> None:
    keys = blobs(heads=3, per_cluster=8, clusters=3, dim=16, seed=7)
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    ids = ClusterKV(cluster_tokens=8).cluster_ids(keys, torch.arange(24).expand(valid.shape), valid)
    blob = torch.arange(24) % 3
    for head in range(3):  # the same partition as the blobs, up to the clusters' names
        pairs = {(int(a), int(b)) for a, b in zip(ids[0, head], blob)}
        assert len(pairs) == 3 and len({a for a, _ in pairs}) == 3


@settings(max_examples=40, deadline=None)
@given(held=st.lists(st.integers(0, 20), min_size=2, max_size=3), cluster_tokens=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_the_arrangement_lists_each_valid_slot_once_cluster_by_cluster(held, cluster_tokens, seed) -> None:
    slots = max(held) + 2
    generator = torch.Generator().manual_seed(seed)
    valid = torch.zeros(1, len(held), slots, dtype=torch.bool)
    for head, n in enumerate(held):
        valid[0, head, torch.randperm(slots, generator=generator)[:n]] = True
    positions = torch.where(valid, torch.randperm(slots, generator=generator).expand_as(valid), -1)
    keys = torch.randn(1, len(held), slots, 4, generator=generator)
    view = LayerView(3, 4, keys, keys, positions, valid)
    policy = ClusterKV(cluster_tokens=cluster_tokens)
    order = policy.arrangement(view)
    clusters = policy.cluster_ids(keys, positions, valid)
    assert order.shape == valid.shape and order.dtype == torch.int64
    for head, n in enumerate(held):
        listed = order[0, head]
        assert bool((listed[n:] == -1).all()) and sorted(listed[:n].tolist()) == valid[0, head].nonzero().flatten().tolist()
        ranks = [(int(clusters[0, head, s]), int(positions[0, head, s])) for s in listed[:n]]
        assert ranks == sorted(ranks)


def test_page_scores_match_the_loop_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    low = torch.randn(2, 2, 5, 4, generator=generator)
    high = low + torch.rand(2, 2, 5, 4, generator=generator)
    query = torch.randn(2, 6, 1, 4, generator=generator)  # 3 query heads per KV head
    scores = ClusterKV().page_scores(query, low, high)
    for b in range(2):
        for h in range(2):
            for p in range(5):
                centre = (low[b, h, p] + high[b, h, p]) / 2
                expected = max(float(query[b, g, 0] @ centre) for g in range(h * 3, h * 3 + 3))
                assert abs(float(scores[b, h, p]) - expected) < 1e-5


def test_a_step_reads_the_newest_page_and_the_best_centres() -> None:
    low = torch.zeros(1, 1, 6, 2)
    high = torch.zeros(1, 1, 6, 2)
    high[0, 0, 2] = torch.tensor([4.0, 0.0])  # centre (2, 0): the query's direction
    high[0, 0, 4] = torch.tensor([2.0, 0.0])
    high[0, 0, 1] = torch.tensor([0.0, 9.0])  # far along the other channel
    query = torch.tensor([[[[1.0, -0.1]]]])
    chosen = ClusterKV(top_k=3).select_pages(0, query, low, high, torch.tensor([[6]]))
    assert chosen.tolist() == [[[2, 4, 5]]]
    assert ClusterKV(top_k=8).select_pages(0, query, low, high, torch.tensor([[4]])).tolist() == [[[0, 1, 2, 3, -1, -1]]]


def test_only_multi_token_calls_of_sparse_layers_are_arranged() -> None:
    policy = ClusterKV(dense_layers=2)
    assert policy.arranges_tokens(2, 30) and not policy.arranges_tokens(1, 30) and not policy.arranges_tokens(2, 1)
    assert policy.sparse(2, 1) and not policy.sparse(2, 5) and not policy.sparse(0, 1)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("clusterkv(cluster_tokens=0)", "cluster_tokens must be >= 1"),
        ("clusterkv(iterations=0)", "iterations must be >= 1"),
        ("clusterkv(top_k=0)", "top_k must be >= 1"),
        ("clusterkv(placement='quest')", "placement must be a device/host placement"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_policy(spec)


def test_registered_as_a_tiering_policy() -> None:
    assert "clusterkv" in kvlib.available_policies()["tiering"]
    assert kvlib.parse_policy("clusterkv(top_k=4)").spec() == "clusterkv(top_k=4)"
