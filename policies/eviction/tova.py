"""TOVA: keep the tokens the last query attends to most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.registry import register
from kvlib.strategy import Eviction, LayerView


@register("tova")
@dataclass
class TOVA(Eviction):
    """TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): at each step keep the tokens
    with the highest attention from the newest query, averaged over the query heads that share a
    KV head (the paper averages over all heads; per KV group keeps heads free to differ).

    Needs the current step's attention weights. No parameters.
    """

    needs: ClassVar[frozenset[str]] = frozenset({"attention"})
    order_free: ClassVar[bool] = True

    def score(self, view: LayerView) -> torch.Tensor:
        """Attention of the last query, mean over the query heads of each KV group."""
        batch, heads, slots = view.valid.shape
        last = view.attention[:, :, -1, :].float()
        return last.reshape(batch, heads, -1, slots).mean(dim=2)
