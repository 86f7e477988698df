"""Score-aware placement: the pages an eviction scorer rates lowest leave the device first."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlib.placement import PageStats, lowest_score_first
from kvlib.policies.eviction.knorm import KNorm
from kvlib.policies.tiering.lru import LRUPlacement
from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("score_aware")
@dataclass
class ScoreAwarePlacement(LRUPlacement):
    """Device and host budgets as ``lru`` (lossless: outputs equal the untiered cache's), but the
    device keeps the pages an eviction policy's per-token ``score`` rates highest: a page scores
    its best stored token (padding never counts), and when device room is needed the lowest-scored
    pages move to the host first (among equal scores, the least recently written; a new page
    counts as best until it is scored).

    When scores are refreshed (when it is cheap: the layer's keys have just been read densely for
    attention, and the scorer needs nothing else): after every call with more than one new token
    (prefill, prefill chunks) and after each decode step that brings the layer's token count to a
    multiple of ``refresh``. A refresh re-ranks the layer's pages and moves the best-scored ones
    onto the device (one batched move each way), so the device then holds exactly the top pages
    in use. Under ``quest(placement=score_aware(...))`` only dense calls (prefill, the dense
    layers) refresh. Each refresh brings the page scores to the CPU (one synchronisation).

    Args:
        device_mb, host_mb: as ``lru``.
        scorer: an eviction policy that needs nothing beyond keys, values and positions
            (``knorm``, ``keydiff``, ``streaming_llm``, ``random``), a policy or a spec string.
        refresh: decode steps between re-rankings, in tokens seen per layer (>= 1).
    """

    scorer: Eviction = field(default_factory=KNorm)
    refresh: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scorer.needs:
            raise ValueError(
                f"scorer {self.scorer.spec()} needs {sorted(self.scorer.needs)}; score_aware scores pages from keys,"
                " values and positions only: use knorm, keydiff, streaming_llm or random"
            )
        if self.refresh < 1:
            raise ValueError(f"refresh must be >= 1 (decode steps between re-rankings), got {self.refresh}")

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        """Lowest-scored pages leave the device first, the least recently written among equals;
        the host's pages go to disk least recently written first
        (:func:`~kvlib.placement.lowest_score_first`)."""
        return lowest_score_first(pages)

    def refreshes_ranking(self, tokens_seen: int, query_length: int) -> bool:
        return query_length > 1 or tokens_seen % self.refresh == 0

    def ranking_scores(self, view: LayerView) -> torch.Tensor:
        return self.scorer.score(view).float().masked_fill(~view.valid, float("-inf"))
