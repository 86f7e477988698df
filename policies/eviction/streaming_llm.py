"""StreamingLLM: attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register
from kvlib.selection import position_rank


@register("streaming_llm")
@dataclass
class StreamingLLM(Eviction):
    """StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

    Keeps the first ``sinks`` stored tokens of each head (the attention sinks that absorb
    surplus attention) and the most recent tokens; the recent window is whatever the budget
    leaves after the sinks. Needs nothing from attention, so it costs no extra compute. Under a
    held cap (an int budget) the window is a ring of slots (:meth:`ring_start`): each decode step's
    token replaces the window's oldest before the step runs, as the paper's code evicts to make
    space before each forward, so a head never holds more than its cap.

    Args:
        sinks: initial tokens always kept (the paper finds 4 enough). Counts toward the budget.
    """

    sinks: int = 4
    reads_kv: ClassVar[bool] = False
    order_free: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def ring_start(self) -> int:
        """The sinks: past them, a head at its cap always drops its oldest token."""
        return self.sinks

    def score(self, view: LayerView) -> torch.Tensor:
        """Recency rank among valid slots (by position); sinks score +inf, invalid slots -inf."""
        rank = position_rank(view.positions, view.valid).to(torch.float32)
        score = torch.where(rank < self.sinks, torch.inf, rank)
        return torch.where(view.valid, score, -torch.inf)
