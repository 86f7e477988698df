"""ClusterKV: keys clustered in semantic space, pages of a cluster recalled per decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.policies.tiering.quest import Quest
from kvlib.policy import LayerView
from kvlib.registry import register


@register("clusterkv")
@dataclass
class ClusterKV(Quest):
    """ClusterKV (Liu et al., 2024, "ClusterKV: Manipulating LLM KV Cache in Semantic Space for
    Recallable Compression"): the keys of each (row, KV head) are clustered by direction (k-means
    with cosine similarity); at each decode step the clusters whose centroids score highest
    against the query are recalled and attention runs over their tokens only; tokens not recalled
    stay stored (on the host tier when a ``placement`` moves them there) and may be recalled at
    the next step. Nothing is evicted.

    Built on the page machinery rather than beside it: after every multi-token call (a prompt or
    a chunk of one) each head's stored tokens are clustered and the store puts them in cluster
    order (:meth:`arrangement`; clusters one after another, each cluster's tokens by position),
    so a cluster fills consecutive pages. The store keeps each page's key minimum and maximum on
    the device (as for :class:`Quest`); a page's centre ``(min + max) / 2`` stands for the
    centroid of the cluster that fills it, and a decode step reads the ``top_k`` pages whose
    centre has the largest dot product with the query (the largest over the query heads of a KV
    group). Recall is thus by cluster, in pages: a cluster of ``n`` tokens is ``n / page_size``
    pages (a page that straddles two clusters is scored by its own centre), and the budget
    ``top_k`` counts pages, as Quest's does, so the two compare at equal pages read.

    Departures from the paper, each a consequence of recalling pages: the centroid is the page's
    box centre, not the k-means mean (the store keeps min and max per page, not sums); tokens
    written while decoding are not re-clustered (they fill pages in position order, each scored
    by its own centre; the paper clusters them every few hundred steps); the page holding the
    newest tokens is always read, and a head holding at most ``top_k`` pages reads all of them.
    The paper keeps the first tokens (attention sinks) apart; here they are clustered like the
    rest. The first ``dense_layers`` layers attend densely and are not arranged.

    Args:
        top_k, dense_layers, placement: as in :class:`Quest` (pages read per head and decode
            step, newest included; leading dense layers; the device/host placement giving page
            budgets, ``lru(device_mb=...)``).
        cluster_tokens: mean tokens per cluster: a head of ``n`` tokens forms
            ``ceil(n / cluster_tokens)`` clusters (the paper uses about 80; >= 1).
        iterations: k-means (Lloyd) iterations (>= 1).
    """

    cluster_tokens: int = 64
    iterations: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cluster_tokens < 1:
            raise ValueError(f"cluster_tokens must be >= 1 (tokens per cluster), got {self.cluster_tokens}")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")

    def page_scores(self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
        """The query's dot product with each page's centre, float32 ``[batch, kv_heads, pages]``
        (the largest over the query heads of each KV group)."""
        batch, kv_heads, pages, dim = key_min.shape
        q = query[:, :, -1].float().view(batch, kv_heads, -1, dim)
        centre = (key_min.float() + key_max.float()) / 2
        return torch.einsum("bhgd,bhpd->bhgp", q, centre).amax(2)

    def arranges_tokens(self, layer_idx: int, query_length: int) -> bool:
        """After every multi-token call of a sparse layer."""
        return query_length > 1 and layer_idx >= self.dense_layers

    def arrangement(self, view: LayerView) -> torch.Tensor:
        """Each head's valid slots in cluster order (clusters by index, tokens of a cluster by
        position), ``-1`` last: int64 ``[batch, kv_heads, slots]``."""
        clusters = self.cluster_ids(view.keys, view.positions, view.valid)
        past = int(view.positions.max()) + 1 if view.positions.numel() else 1
        rank = torch.where(view.valid, clusters * past + view.positions, torch.iinfo(torch.int64).max)
        order = torch.sort(rank, dim=-1, stable=True).indices
        return torch.where(view.valid.gather(-1, order), order, -1)

    def cluster_ids(self, keys: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """int64 ``[batch, kv_heads, slots]``: each valid key's cluster (0 for invalid slots).

        Spherical k-means per (row, head) on the unit key directions: ``ceil(n / cluster_tokens)``
        clusters for the head's largest valid count ``n``, initial centroids the keys at evenly
        spaced ranks of position (``j * n // clusters``-th oldest valid token: whatever slots the
        keys lie in, the clusters are the same), then ``iterations`` rounds of assigning each key to its most similar
        centroid (cosine) and moving each centroid to its members' normalised mean (an empty
        cluster keeps its centroid). Deterministic."""
        directions = torch.nn.functional.normalize(keys.float(), dim=-1) * valid.unsqueeze(-1)
        counts = valid.sum(-1)
        clusters = max(1, -(-int(counts.max()) // self.cluster_tokens))
        ranks = (torch.arange(clusters, device=keys.device) * counts.unsqueeze(-1)) // clusters
        slot_of_rank = torch.sort(torch.where(valid, positions, torch.iinfo(torch.int64).max), dim=-1).indices
        start = slot_of_rank.gather(-1, ranks.clamp(max=valid.shape[-1] - 1))
        centroids = directions.gather(2, start.unsqueeze(-1).expand(*start.shape, directions.shape[-1]))
        for _ in range(self.iterations):
            assign = torch.einsum("bhsd,bhcd->bhsc", directions, centroids).argmax(-1)
            sums = torch.zeros_like(centroids).scatter_add_(2, assign.unsqueeze(-1).expand_as(directions), directions)
            members = torch.zeros(*centroids.shape[:3], device=keys.device).scatter_add_(2, assign, valid.float())
            moved = torch.nn.functional.normalize(sums, dim=-1)
            centroids = torch.where((members > 0).unsqueeze(-1), moved, centroids)
        assign = torch.einsum("bhsd,bhcd->bhsc", directions, centroids).argmax(-1)
        return torch.where(valid, assign, 0)
