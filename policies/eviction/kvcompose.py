"""KVCompose: per-head attention scores, with every head of a layer keeping the same count (composite tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("kvcompose")
@dataclass
class KVCompose(Eviction):
    """KVCompose (Akulov, Sana, De Domenico, Si Salem, Piovesan and Ayed, 2025, "KVCompose: Efficient
    Structured KV Cache Compression with Composite Tokens", arXiv:2509.05165), scored as kvpress's
    ``KVComposePress``: each KV head ranks its tokens by its own attention scores, and the ``r``-th
    best token of every head of a layer form the layer's ``r``-th *composite token*, so every head
    keeps the same number of tokens (different tokens per head) and the cache stays one dense
    ``[heads, tokens]`` layout.

    Scores per (row, KV head, token), as ``compute_scores`` and ``enhance_scores`` do:

    1. each query head aggregates the attention its observed queries (the call's last ``window``)
       give the token: ``task="max"`` (kvpress's default) or ``"mean"``;
    2. the query heads of a KV group are aggregated: ``group="mean"`` (default) or ``"max"``;
    3. with ``value_norm``, times the L2 norm of the token's value;
    4. with ``mean_across_heads`` (default), plus the mean of that token's score over the layer's
       KV heads (kvpress's ``add_mean_across_heads``). Tokens are matched across heads by position
       (heads that have evicted differently still agree which token is which); the mean runs over
       the heads that hold the token.

    Each head keeps its best tokens by these scores, within the cap the allocation gives it; under
    the default (uniform) allocation every head of a layer keeps the same count, the composite
    layout. Here a per-head budget is real memory in any case (per-head pages), so the alignment
    costs nothing and saves nothing. Not built: the paper's cross-layer allocation (a global top-k
    over every layer's composite scores, the mean over heads of each rank's score, the first layer
    given the largest), which needs every layer's scores before the first layer compacts, while a
    cache here compacts each layer right after its own attention; each layer keeps the call's
    budget instead. kvpress feeds the context a second time to observe the attention of its
    tokens over the first copy; here the observed queries are the call's own last ``window``.

    Invariants: invalid slots score ``-inf``; scores are finite and >= 0 elsewhere.

    Args:
        window: observed queries, the call's last (>= 1).
        task: aggregation over the observed queries, ``"max"`` or ``"mean"``.
        group: aggregation over a KV group's query heads, ``"mean"`` or ``"max"``.
        value_norm: multiply by the value's L2 norm (kvpress's ``add_v_norm``; reads the values).
        mean_across_heads: add the token's mean score over the layer's KV heads.
    """

    window: int = 32
    task: Literal["max", "mean"] = "max"
    group: Literal["mean", "max"] = "mean"
    value_norm: bool = False
    mean_across_heads: bool = True
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (queries), got {self.window}")

    @property
    def reads_kv(self) -> bool:
        """Whether :meth:`score` reads the values: only with ``value_norm`` (see :attr:`Eviction.reads_kv`)."""
        return self.value_norm

    def observed_queries(self) -> int:
        return self.window

    def score(self, view: LayerView) -> torch.Tensor:
        """Aggregated attention per KV head (times the value norm), plus its mean over the heads."""
        batch, heads, slots = view.valid.shape
        attention = view.attention[:, :, -self.window :, :].float()
        per_query_head = attention.amax(dim=2) if self.task == "max" else attention.mean(dim=2)
        grouped = per_query_head.view(batch, heads, -1, slots)
        scores = grouped.mean(dim=2) if self.group == "mean" else grouped.amax(dim=2)
        if self.value_norm:
            scores = scores * view.values.float().norm(dim=-1)
        scores = scores.masked_fill(~view.valid, 0.0)
        if self.mean_across_heads:
            scores = scores + _mean_by_position(scores, view)
        return scores.masked_fill(~view.valid, -torch.inf)


def _mean_by_position(scores: torch.Tensor, view: LayerView) -> torch.Tensor:
    """float32 ``[batch, kv_heads, slots]``: for each held token, the mean of its score over the
    layer's KV heads that hold its position (0 on invalid slots)."""
    batch, heads, slots = scores.shape
    width = int(view.positions.max()) + 2 if view.positions.numel() else 1
    at = torch.where(view.valid, view.positions, width - 1).view(batch, heads * slots)  # the last column: no position
    totals = torch.zeros(batch, width, dtype=scores.dtype, device=scores.device).scatter_add_(-1, at, scores.view(batch, -1))
    holders = torch.zeros_like(totals).scatter_add_(-1, at, view.valid.to(scores.dtype).view(batch, -1))
    mean = totals / holders.clamp(min=1.0)
    return mean.gather(-1, at).view(batch, heads, slots).masked_fill(~view.valid, 0.0)
