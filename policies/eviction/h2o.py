"""H2O: keep the heavy hitters (most attention received so far) and a window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register
from kvlib.selection import position_rank


@register("h2o")
@dataclass
class H2O(Eviction):
    """H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models"): a token's importance is the attention it has accumulated, summed
    over every query since it was stored (prefill and each decode step; averaged over the query
    heads of its KV group). Each head keeps its ``recent`` newest tokens and fills the rest of its
    budget with the heavy hitters, the highest accumulated attention among its older tokens.

    The paper splits the budget equally between the two (e.g. 10% + 10% of the sequence). A
    policy here only scores tokens and the engine applies the budget, so the window is a token
    count: ``recent = budget / 2`` reproduces the paper's split. If a head's budget is below
    ``recent``, it keeps its newest ``budget`` tokens (a sliding window).

    Args:
        recent: newest stored tokens of each head always kept (tokens, >= 0; 0 keeps by
            accumulated attention alone). Counts toward the budget.
    """

    recent: int = 32
    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"accumulated_attention"})
    order_free: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0, got {self.recent}")

    def score(self, view: LayerView) -> torch.Tensor:
        """Accumulated attention; the recent window above every such score, newest highest."""
        return protected_scores(view.accumulated_attention.float(), view, recent=self.recent)


def protected_scores(importance: torch.Tensor, view: LayerView, recent: int, sinks: int = 0) -> torch.Tensor:
    """Keep-scores that rank, in each head: its ``recent`` newest valid tokens (newest first), then
    the tokens at positions below ``sinks`` (earliest first), then the rest by ``importance``.

    ``importance`` float ``[batch, kv_heads, slots]``, >= 0 on valid slots. The protected tokens get
    finite scores stacked above the row's largest importance (over all its heads, so scores stay
    comparable across heads) rather than ``+inf``: ``+inf`` ties keep position order, so a head with a
    budget smaller than its protected tokens would keep the oldest of its window and drop the
    token it just stored. Returns float64 (the offsets stay exact); invalid slots are ``-inf``.
    """
    valid = view.valid
    importance = importance.to(torch.float64).masked_fill(~valid, 0.0)
    ceiling = importance.amax(dim=(1, 2), keepdim=True) + 1.0
    from_end = valid.sum(-1, keepdim=True) - 1 - position_rank(view.positions, valid)  # 0 for the newest valid token
    scores = torch.where(view.positions < sinks, ceiling + (sinks - view.positions), importance)
    scores = torch.where(from_end < recent, ceiling + sinks + (recent - from_end), scores)
    return scores.masked_fill(~valid, -torch.inf)
