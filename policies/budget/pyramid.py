"""Pyramid allocation: budgets shrink linearly with depth (PyramidKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.policy import Budget, BudgetRequest
from kvlib.registry import register
from kvlib.selection import apportion


@register("pyramid")
@dataclass
class Pyramid(Budget):
    """PyramidKV's allocation (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling"): attention is broad in lower layers and narrows with depth,
    so layer budgets fall linearly from the first layer to the last while their mean stays the
    spec's budget ``B``.

    With ``L`` layers the last layer keeps ``B / beta`` tokens per head, the first
    ``2B - B / beta``, and layer ``l`` in between on the line joining them (the paper's
    arithmetic sequence). Per-layer counts are rounded so that they sum to exactly ``L * B``
    per head; every head of a layer keeps the same count.

    With ``reserved`` tokens (PyramidKV's observation window, kept in every layer), each layer
    gets ``min(reserved, B)`` first and the pyramid splits the rest, as the official code does.

    Args:
        beta: ratio of the mean budget to the last layer's budget (the paper's default 20); >= 1.
            ``beta = 1`` is the uniform allocation.
        reserved: tokens per head every layer keeps before the pyramid split (>= 0).
    """

    beta: int = 20
    reserved: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be an int >= 1, got {self.beta}")
        if self.reserved < 0:
            raise ValueError(f"reserved must be an int >= 0, got {self.reserved}")

    def layer_tokens(self, request: BudgetRequest) -> torch.Tensor:
        """This layer's share of ``L * tokens`` (per head) times the head count."""
        return self._per_head(request) * request.counts.shape[1]

    def caps(self, request: BudgetRequest) -> torch.Tensor:
        """The layer's per-head count for every head."""
        return self._per_head(request).unsqueeze(-1).expand_as(request.counts).clone()

    def _per_head(self, request: BudgetRequest) -> torch.Tensor:
        layers = request.num_layers
        if layers == 1:
            return request.tokens.clone()
        tokens = request.tokens.cpu()
        reserved = tokens.clamp(max=self.reserved)
        top, bottom = 2.0 - 1.0 / self.beta, 1.0 / self.beta
        depth = torch.arange(layers, dtype=torch.float64) / (layers - 1)
        weights = top + (bottom - top) * depth
        per_layer = reserved.unsqueeze(-1) + apportion((tokens - reserved) * layers, weights)
        return per_layer[:, request.layer_idx].to(request.tokens.device)
