"""KNorm: keep the keys with the lowest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("knorm")
@dataclass
class KNorm(Eviction):
    """KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Policy for KV Cache
    Compression"): keys with a low L2 norm draw high attention, so the lowest-norm keys are kept.

    Attention-free: needs nothing beyond the stored keys. No parameters.
    """

    order_free: ClassVar[bool] = True

    def score(self, view: LayerView) -> torch.Tensor:
        """Minus each key's L2 norm (computed in float32)."""
        return -view.keys.float().norm(dim=-1)
