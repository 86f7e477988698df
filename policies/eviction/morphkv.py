"""MorphKV: a constant-size cache of the recent window and the older tokens it attends to most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlib.policies.eviction.h2o import protected_scores
from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("morphkv")
@dataclass
class MorphKV(Eviction):
    """MorphKV (Ghadia et al., 2025, "Dialogue without Limits: Constant-Sized KV Caches for
    Extended Responses in LLMs"): each head keeps its ``window`` newest tokens (R) and, of the
    older ones, those the window's queries attend to most; re-evaluated as decoding goes, so the
    cache stays at the budget (R + C tokens per head) however long the response.

    A token's score is its attention from the layer's last ``window`` queries (kept across decode
    steps by the engine, ``recent_queries``; each one's softmax over the keys stored now, causal),
    fused over those queries by ``fusion`` (``"sum"``: the total attention the window gives it;
    ``"max"``: the most any one window query gives it, which keeps tokens a single recent step
    relied on) for each query head, then averaged over the query heads of its KV group.

    Decode-time eviction needs an int budget (the cache holds ``budget`` tokens per head on
    average; ``interval`` re-evaluates every that many steps); a float budget compresses the
    prompt only, with the prompt's last ``window`` queries voting.

    Args:
        window: recent tokens kept in every head and the queries that vote (R, tokens >= 1).
            Counts toward the budget.
        fusion: how a token's attention from the window's queries is combined, ``"sum"`` or
            ``"max"`` (the paper's two variants).
    """

    window: int = 32
    fusion: Literal["sum", "max"] = "sum"
    needs: ClassVar[frozenset[str]] = frozenset({"recent_queries"})
    order_free: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (tokens), got {self.window}")

    def observed_queries(self) -> int:
        return self.window

    def score(self, view: LayerView) -> torch.Tensor:
        """Fused window attention per KV group; the window's own tokens above every such score."""
        batch, heads, slots = view.valid.shape
        attention = view.recent_attention.float()  # [batch, query_heads, window, slots]
        fused = attention.sum(dim=2) if self.fusion == "sum" else attention.amax(dim=2)
        importance = fused.view(batch, heads, -1, slots).mean(dim=2)
        return protected_scores(importance, view, recent=self.window)
