"""VATP: accumulated attention weighted by the L1 norm of each token's value vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policies.eviction.h2o import H2O, protected_scores
from kvlib.policy import LayerView
from kvlib.registry import register


@register("vatp")
@dataclass
class VATP(H2O):
    """Value-Aware Token Pruning (Guo et al., 2024, "Attention Score is not All You Need for Token
    Importance Indicator in KV Cache Reduction: Value Also Matters"), in its H2O form: a token's
    importance is its accumulated attention (an :class:`~kvlib.policies.eviction.h2o.H2O`, whose
    ``recent`` window and checks it keeps) times the L1 norm of its value vector, since a token
    contributes to the attention output in proportion to both.

    Attention sinks draw much attention but have tiny value norms, so the importance would drop
    them; like the paper, the first ``sinks`` tokens are always kept. Like H2O, each head also
    keeps its ``recent`` newest tokens (the paper gives them half the budget). When a head's
    budget cannot hold both, the recent window goes first (newest first), then the sinks
    (earliest first), as in the authors' code, where the window has a budget of its own and the
    sinks take the heavy-hitter budget first.

    Args:
        recent: newest stored tokens of each head always kept (tokens, >= 0). Counts toward the
            budget; ``budget / 2`` is the paper's split.
        sinks: tokens at the start of the sequence (positions ``0 .. sinks - 1``) always kept
            (tokens, >= 0; the authors' LongBench runs use 20). Count toward the budget.
    """

    sinks: int = 20
    reads_kv: ClassVar[bool] = True  # the value norms

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def score(self, view: LayerView) -> torch.Tensor:
        """Accumulated attention times value L1 norm; recent window, then sinks, above every such score."""
        importance = view.accumulated_attention.float() * view.values.float().abs().sum(-1)
        return protected_scores(importance, view, recent=self.recent, sinks=self.sinks)
