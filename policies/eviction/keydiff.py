"""KeyDiff: keep the keys least similar to the mean key."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("keydiff")
@dataclass
class KeyDiff(Eviction):
    """KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"): distinctive
    keys (low cosine similarity to the mean of the head's stored keys) are kept.

    Attention-free. The mean runs over each head's valid keys only. No parameters.
    """

    def score(self, view: LayerView) -> torch.Tensor:
        """Minus the cosine similarity of each key to its head's mean valid key."""
        keys = view.keys.float()
        weights = view.valid.unsqueeze(-1).float()
        mean = (keys * weights).sum(-2, keepdim=True) / weights.sum(-2, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(keys, mean, dim=-1)
