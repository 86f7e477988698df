"""Uniform allocation: every layer and head keeps the same number of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.policy import Budget, BudgetRequest
from kvlib.registry import register


@register("uniform")
@dataclass
class Uniform(Budget):
    """Every (layer, KV head) keeps the spec's budget: the allocation used when a spec names none
    (and its eviction policy brings no default). No parameters."""

    def caps(self, request: BudgetRequest) -> torch.Tensor:
        """``tokens`` for every head."""
        return request.tokens.unsqueeze(-1).expand_as(request.counts).clone()
