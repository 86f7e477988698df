"""SnapKV: keep what the observation window attends to, pooled with its neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("snapkv")
@dataclass
class SnapKV(Eviction):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    The last ``window`` queries of a call (the observation window) vote for the stored tokens:
    each query head sums the attention its window queries give each token (the paper's
    ``C = sum_i W_obs[:, i, :]``), pools the votes along the slot axis with a ``kernel``-wide
    window (stride 1, zero padding at the edges counted in the average, as the official code's
    ``avg_pool1d``), and the pooled votes are averaged over the query heads of each KV group (as
    kvpress does for GQA; the official code repeats KV heads and so selects per query head). The
    window's own tokens score ``+inf``: they are always kept, as in the paper.

    Invariants: pooling runs over the context tokens only (valid slots that are not in the
    window), as the official code pools the prefix without the window; invalid slots and window
    tokens count as 0 (``avg``) or ``-inf`` (``max``) there, so nothing leaks from padding or from
    the window's large self-attention into a neighbour's score. Slots are pooled in stored order
    (ascending positions), so after an earlier eviction the neighbours are the nearest stored
    tokens. In a decode step the window is the single new query and its token.

    Args:
        window: observation window, in queries (the last ``window`` of the call; fewer if the
            call has fewer). The official code's default is 32.
        kernel: pooling width, in slots; odd, so the pooled score stays centred (1: no pooling).
            The paper and the official code use 5.
        pooling: ``"avg"`` (the official code's default, ``avgpool``) or ``"max"`` (its
            ``maxpool`` option).
    """

    window: int = 32
    kernel: int = 5
    pooling: Literal["avg", "max"] = "avg"
    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (queries), got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd integer >= 1 (slots), got {self.kernel}")

    def observed_queries(self) -> int:
        return self.window

    def score(self, view: LayerView) -> torch.Tensor:
        """Pooled window attention per KV group; window tokens ``+inf``, invalid slots ``-inf``."""
        batch, heads, slots = view.valid.shape
        attention = view.attention[:, :, -self.window :, :].float()  # [batch, query_heads, observed, slots]
        in_window = self.window_tokens(view, attention.shape[2])
        groups = attention.shape[1] // heads
        context = (view.valid & ~in_window).repeat_interleave(groups, dim=1)
        votes = attention.sum(dim=2).reshape(-1, 1, slots)
        pad = self.kernel // 2
        if self.pooling == "avg":
            pooled = F.avg_pool1d(votes.masked_fill(~context.reshape(-1, 1, slots), 0.0), self.kernel, 1, pad)
        else:
            pooled = F.max_pool1d(votes.masked_fill(~context.reshape(-1, 1, slots), -torch.inf), self.kernel, 1, pad)
        scores = pooled.reshape(batch, heads, groups, slots).mean(dim=2)
        scores = torch.where(in_window, torch.inf, scores)
        return torch.where(view.valid, scores, -torch.inf)

    @staticmethod
    def window_tokens(view: LayerView, observed: int) -> torch.Tensor:
        """Bool ``[batch, kv_heads, slots]``: the valid tokens of the call's last ``observed`` queries.

        They are the newest ``observed`` positions of each row: every head holds the newest token
        (written by this call), and a row's queries are consecutive positions.
        """
        newest = view.positions.amax(dim=-1, keepdim=True)
        return view.valid & (view.positions > newest - observed)
