"""Ada-KV allocation: one top-k across the heads of a layer, with a floor per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.policy import Budget, BudgetRequest
from kvlib.registry import register
from kvlib.selection import rank_order


@register("adaptive")
@dataclass
class Adaptive(Budget):
    """Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference"): a layer's heads share ``heads * B`` tokens, taken
    by one top-k over the eviction scores of all its heads, so heads whose attention is
    concentrated give up tokens to heads whose attention is spread out.

    Each head first keeps its ``floor(floor * B)`` best tokens (Ada-KV's safeguard, which keeps
    a head from being starved); the rest of the layer's budget goes to the best remaining
    tokens of any head. Scores must be comparable across heads (attention-based scores are:
    each head's attention sums to one per query). The layer keeps exactly ``heads * B`` tokens
    when its heads hold that many.

    Args:
        floor: fraction of the budget each head is guaranteed, in [0, 1] (Ada-KV's alpha, 0.2).
    """

    floor: float = 0.2
    needs_scores = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")

    def caps(self, request: BudgetRequest) -> torch.Tensor:
        """Floor tokens per head plus each head's share of the layer-wide top-k of the rest."""
        scores, candidates, counts = request.scores, request.candidates, request.counts.to(request.scores.device)
        batch, heads, slots = scores.shape
        tokens = request.tokens.to(scores.device)
        reserved = torch.minimum((tokens.to(torch.float64) * self.floor).floor().to(torch.int64).unsqueeze(-1), counts)
        order = rank_order(scores, candidates)
        ranked = scores.gather(-1, order)
        rank = torch.arange(slots, device=scores.device)
        open_slot = (rank >= reserved.unsqueeze(-1)) & (rank < counts.unsqueeze(-1))
        remaining = (tokens * heads - reserved.sum(-1)).clamp(min=0)
        flat_scores = torch.where(open_slot, ranked, -torch.inf).flatten(1)
        flat_open = open_slot.flatten(1)
        winners = rank_order(flat_scores, flat_open)
        taken = torch.arange(heads * slots, device=scores.device) < torch.minimum(remaining, flat_open.sum(-1)).unsqueeze(-1)
        chosen = torch.zeros_like(flat_open).scatter(-1, winners, taken)
        return reserved + chosen.view(batch, heads, slots).sum(-1)
