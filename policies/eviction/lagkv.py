"""LagKV: score each partition of the cache against the partition after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("lagkv")
@dataclass
class LagKV(Eviction):
    """LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which
    Tokens Are Important"; kvpress ``LagKVPress``). Attention-free.

    Each head's stored tokens after the first ``n_sink`` are cut, in stored order, into partitions
    of ``lag_size`` tokens. A partition's keys are min-max normalised per channel with the min and
    max of the NEXT partition's keys (the lag reference), and so are its values; a token's score
    is ``softmax_partition(std_channels(K_norm)) + softmax_partition(std_channels(V_norm))``
    (unbiased std; a channel whose reference range is zero is only shifted, not divided). The
    last full partition and the remainder after it have no reference: with the sinks they form
    the window that is always kept.

    Partitions follow each head's stored order among its valid slots, wherever its invalid
    slots (padding) sit. Scores: sinks +inf; the window ``2 + rank among the valid slots`` (above
    every partition score, newest first, so a budget smaller than the window keeps its most
    recent tokens); partition tokens their rank within the partition divided by ``lag_size`` (in
    ``[0, 1)``, so a budget takes the same share of every partition, as the paper's
    per-partition top-k does; ties at the threshold go to earlier partitions), or with
    ``cross_scoring`` the score itself (in ``[0, 2]``, summing to 2 per partition, comparable
    across heads); invalid slots -inf. Scores of a row depend only on that row.

    Args:
        n_sink: initial stored tokens always kept (attention sinks).
        lag_size: tokens per partition; the next partition is the reference of the one before.
        cross_scoring: give partition tokens their raw score instead of the in-partition rank.
    """

    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.lag_size < 2:
            raise ValueError(f"lag_size must be >= 2 (a reference needs a min-max range), got {self.lag_size}")

    def partition_scores(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., partitions - 1, lag_size]``: softmax over each partition of the channel std of
        ``states [..., partitions, lag_size, dim]`` normalised by the next partition's range."""
        reference = states[..., 1:, :, :]
        low = reference.min(dim=-2, keepdim=True).values
        span = reference.max(dim=-2, keepdim=True).values - low
        normalised = (states[..., :-1, :, :] - low) / torch.where(span > 0, span, 1.0)
        return normalised.std(dim=-1).softmax(dim=-1)

    def lag_scores(self, keys: torch.Tensor, values: torch.Tensor, partitions: int) -> torch.Tensor:
        """``[batch, heads, slots]``: the rank (or score) of the tokens of the first ``partitions
        - 1`` partitions of ``keys`` and ``values`` (valid slots first); 0 elsewhere."""
        slots = keys.shape[2]
        region = slice(self.n_sink, self.n_sink + partitions * self.lag_size)
        keys = keys[:, :, region].float().unflatten(2, (partitions, self.lag_size))
        values = values[:, :, region].float().unflatten(2, (partitions, self.lag_size))
        score = self.partition_scores(keys) + self.partition_scores(values)
        if not self.cross_scoring:
            score = score.argsort(dim=-1, stable=True).argsort(dim=-1).float() / self.lag_size
        return torch.nn.functional.pad(score.flatten(2), (self.n_sink, slots - region.stop + self.lag_size))

    def score(self, view: LayerView) -> torch.Tensor:
        """Partition rank (or score); window ``2 + rank``; sinks +inf; invalid slots -inf."""
        batch, heads, slots, _ = view.keys.shape
        order = torch.argsort((~view.valid).to(torch.int8), dim=-1, stable=True)  # valid slots first, in order
        rank = torch.arange(slots, device=view.keys.device)  # index among the head's valid slots
        length = view.valid.sum(-1, keepdim=True)
        partition = (rank - self.n_sink).div(self.lag_size, rounding_mode="floor")  # negative for sinks
        full = (length - self.n_sink).clamp(min=0) // self.lag_size  # full partitions per head
        scored = (rank >= self.n_sink) & (partition < full - 1)  # the next partition is full: a reference
        score = torch.where(rank < self.n_sink, torch.inf, 2.0 + rank.float()).expand(batch, heads, slots)
        partitions = max(0, slots - self.n_sink) // self.lag_size
        if partitions >= 2:
            keys = view.keys.gather(2, order.unsqueeze(-1).expand_as(view.keys))
            values = view.values.gather(2, order.unsqueeze(-1).expand_as(view.values))
            score = torch.where(scored, self.lag_scores(keys, values, partitions), score)
        score = torch.where(rank < length, score, -torch.inf)
        return torch.empty_like(score).scatter_(-1, order, score)
