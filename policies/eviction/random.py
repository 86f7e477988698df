"""Random eviction: the baseline every other policy should beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.params import Seed
from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("random")
@dataclass
class Random(Eviction):
    """Keeps a uniformly random subset of each head's tokens (the comparison baseline).

    Each token draws its score once, from a hash of ``seed``, the layer, the KV head and its
    position, so the score never changes while it is stored: the kept set is a uniform random
    subset of the tokens seen (a new draw every step would keep the same slots instead), runs
    are reproducible, and a row's scores do not depend on the other rows of its batch.

    Args:
        seed: mixed into every token's hash.
    """

    seed: Seed = 0

    reads_kv: ClassVar[bool] = False
    order_free: ClassVar[bool] = True

    def score(self, view: LayerView) -> torch.Tensor:
        """Uniform [0, 1) scores hashed from (seed, layer, head, position); invalid slots ``-inf``."""
        heads = torch.arange(view.valid.shape[1], device=view.positions.device).view(1, -1, 1)
        salt = (self.seed * 1_000_003 + view.layer_idx * 7_919) & _MASK
        mixed = (view.positions.clamp(min=0) * 2_654_435_761 + heads * 40_503 + salt) & _MASK
        for _ in range(2):
            mixed = ((mixed ^ (mixed >> 16)) * 0x45D9F3B) & _MASK
        scores = (mixed ^ (mixed >> 16)).to(torch.float64) / 2.0**32
        return scores.masked_fill(~view.valid, -torch.inf)


_MASK = 0xFFFFFFFF
"""Hash arithmetic stays in 32 bits (products fit in int64 for positions below 2**32)."""
