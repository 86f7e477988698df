"""Random eviction: the baseline every other strategy should beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.registry import register
from kvlib.strategy import Eviction, LayerView


@register("random")
@dataclass
class Random(Eviction):
    """Keeps a uniformly random subset of each head's tokens (the comparison baseline).

    Args:
        seed: seed of the generator; the scores of a layer depend only on ``seed``, the layer
            index and the view's shape, so runs are reproducible.
    """

    seed: int = 0

    def score(self, view: LayerView) -> torch.Tensor:
        """Uniform [0, 1) scores from a generator seeded with ``seed`` and the layer index."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + view.layer_idx)
        return torch.rand(view.valid.shape, generator=generator).to(view.keys.device)
