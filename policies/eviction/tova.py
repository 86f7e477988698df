"""TOVA: keep the tokens the last query attends to most, one kept set for the whole layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("tova")
@dataclass
class TOVA(Eviction):
    """TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): at each step keep the tokens
    with the highest attention from the newest query, averaged over the query heads.

    As published (and as kvpress's ``TOVAPress``), the average runs over all query heads of the
    layer and every head keeps the same tokens: a token's score is the attention the last query
    gives its position, summed over the layer's query heads and divided by their number (a head
    that no longer holds the position adds 0). Every KV head therefore gets the same score for
    the same position, so heads given equal budgets keep the same set. Unlike kvpress, the
    newest token is not forced in: it competes on its own attention, as in the paper.

    Needs the attention weights of the call's last query only.

    Args:
        average: ``"layer"`` (the paper: all query heads of the layer, one kept set per layer) or
            ``"group"`` (the query heads that share each KV head: heads keep different sets).
    """

    average: Literal["layer", "group"] = "layer"
    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})
    order_free: ClassVar[bool] = True

    def observed_queries(self) -> int:
        return 1

    def score(self, view: LayerView) -> torch.Tensor:
        """The last query's attention per stored token, averaged as ``average`` says."""
        batch, heads, slots = view.valid.shape
        last = view.attention[:, :, -1, :].float().reshape(batch, heads, -1, slots)
        if self.average == "group":
            return last.mean(dim=2)
        per_kv_head = last.sum(dim=2).masked_fill(~view.valid, 0.0)
        return by_position_total(per_kv_head, view.positions, view.valid) / last.shape[1] / last.shape[2]


def by_position_total(values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, slots]``: for each slot, the sum of ``values`` over every head's slot that
    holds the same position in the same row (0 for invalid slots).

    Heads may hold different tokens in different slots (after per-head budgets), so the sum goes
    through positions, not slot indices; each position appears at most once per head.
    """
    batch = values.shape[0]
    spill = int(positions.max().clamp(min=0)) + 1  # one past the largest position: where invalid slots go
    index = torch.where(valid, positions, spill).reshape(batch, -1)
    totals = torch.zeros(batch, spill + 1, dtype=values.dtype, device=values.device)
    totals.scatter_add_(1, index, values.reshape(batch, -1))
    gathered = totals.gather(1, index).reshape(values.shape)
    return gathered.masked_fill(~valid, 0.0)
