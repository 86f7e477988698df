"""Random page retrieval: ``quest``'s control, attending over randomly chosen pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.params import Seed
from kvlib.policies.tiering.quest import Quest
from kvlib.registry import register


@register("random_pages")
@dataclass
class RandomPages(Quest):
    """Like ``quest`` (same ``top_k``, ``dense_layers``, ``placement``, newest page always kept,
    same sparse reads) but the other pages are drawn uniformly at random at every decode step,
    ignoring the query: the baseline query-aware retrieval must beat.

    Args:
        seed: seeds this policy's generator (drawn on the CPU; the draws of a run depend on the
            order of its steps only).
    """

    seed: Seed = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._generator = torch.Generator().manual_seed(self.seed)

    def page_scores(self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
        """Uniform [0, 1) scores ``[batch, kv_heads, pages]``, fresh at each call."""
        return torch.rand(key_min.shape[:3], generator=self._generator).to(key_min.device)
