"""CriticalKV: an inner policy's scores corrected by how much each value moves the layer's output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlib.policies.budget.adaptive import Adaptive
from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Budget, BudgetRequest, Eviction, LayerView
from kvlib.registry import register
from kvlib.selection import rank_order

OWN_NEEDS = frozenset({"output_projection", "budget"})
"""What CriticalKV asks for beyond its inner policy's needs."""


class _InnerNeeds:
    """``needs`` of a CriticalKV: on an instance, its inner policy's plus :data:`OWN_NEEDS`; on the
    class (where the registry checks it), :data:`OWN_NEEDS`."""

    def __get__(self, instance: CriticalKV | None, owner: type | None = None) -> frozenset[str]:
        return OWN_NEEDS if instance is None else frozenset(instance.inner.needs) | OWN_NEEDS


@register("critical_kv")
@dataclass
class CriticalKV(Eviction):
    """CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an Output
    Perturbation Perspective"), with Ada-KV's head-wise budgets (the paper's CriticalAdaKV).

    Attention weights alone ignore how far a token's value moves the output: evicting token ``j``
    of head ``h`` perturbs the layer's output by about ``a_j * ||v_j W_o[h]||_1``, where ``W_o[h]``
    is the slice of the attention output projection that head ``h`` goes through. Selection in
    each layer call (as kvpress's ``CriticalAdaKVPress``):

    1. the ``inner`` scores (default SnapKV's window attention) split the layer's budget over its
       KV heads with Ada-KV (one top-k across heads after a ``floor`` share each): ``B_h`` per head;
    2. stage one: each head keeps its ``max(floor(first_stage * B_h), floor(floor * B))`` best
       tokens by the inner score (Ada-KV's guaranteed share is part of it);
    3. stage two: the rest of ``B_h`` goes to the best tokens by ``(inner + epsilon) *
       mean_g ||v_j W_o[g]||_1``, the L1 norm of the value projected through the output projection
       of each query head ``g`` of the KV group, averaged over the group.

    The returned scores are ``+inf`` for the ``B_h`` tokens chosen in each head and the stage-two
    score elsewhere, so the default allocation (``adaptive(floor)``, the same Ada-KV split)
    keeps exactly them. With another allocation in the spec, each head keeps its best tokens by
    these scores within that allocation's caps. Where the call compacts nothing (a codec's
    salience), the scores are the stage-two scores.

    Invariants: the inner's ``+inf`` tokens (SnapKV's window) rank first in every stage; invalid
    slots score ``-inf``. The correction needs the layer's output projection (``o_proj``, or
    GPT-2's ``c_proj``), which ``make_cache`` finds in the model.

    Args:
        inner: the base scorer (an eviction policy or its spec string); its scores must be
            comparable across heads (attention-based), as Ada-KV needs.
        floor: fraction of the average budget each head is guaranteed, in [0, 1] (Ada-KV's alpha).
        first_stage: fraction of each head's budget chosen by the inner score alone, in [0, 1]
            (the paper's and kvpress's ``first_stage_ratio``, 0.5).
        epsilon: added to the inner score before the correction (> 0 keeps zero-attention tokens
            ordered by their value norm), as kvpress's 1e-4.
    """

    inner: Eviction = field(default_factory=SnapKV)
    floor: float = 0.2
    first_stage: float = 0.5
    epsilon: float = 1e-4
    needs = _InnerNeeds()
    reads_kv: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1] (a fraction of the budget), got {self.floor}")
        if not 0.0 <= self.first_stage <= 1.0:
            raise ValueError(f"first_stage must be in [0, 1] (a fraction of each head's budget), got {self.first_stage}")
        if not self.epsilon >= 0.0 or self.epsilon == float("inf"):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon}")

    def observed_queries(self) -> int | None:
        return self.inner.observed_queries()

    def default_budget(self) -> Budget:
        return Adaptive(floor=self.floor)

    def score(self, view: LayerView) -> torch.Tensor:
        """``+inf`` for each head's chosen tokens (when the call has a budget), else the stage-two score."""
        inner = self.inner.score(view).float()
        corrected = torch.where(inner.isfinite(), (inner + self.epsilon) * projected_norms(view), inner)
        corrected = torch.where(view.valid, corrected, -torch.inf)
        if view.budget_tokens is None:
            return corrected
        counts = view.valid.sum(-1)
        tokens = view.budget_tokens.to(counts.device)
        request = BudgetRequest(view.layer_idx, view.num_layers, tokens, counts, torch.where(view.valid, inner, -torch.inf), view.valid)
        head_budgets = Adaptive(floor=self.floor).caps(request).clamp(max=counts)
        guaranteed = (tokens.to(torch.float64) * self.floor).floor().to(torch.int64).unsqueeze(-1)
        first = torch.maximum((head_budgets.to(torch.float64) * self.first_stage).floor().to(torch.int64), guaranteed)
        first = torch.minimum(first, head_budgets)
        chosen = _top(inner, view.valid, first)
        second = torch.where(chosen, torch.inf, corrected)
        chosen |= _top(second, view.valid, head_budgets)
        return torch.where(chosen, torch.inf, corrected)


def projected_norms(view: LayerView) -> torch.Tensor:
    """float32 ``[batch, kv_heads, slots]``: ``||v_j W_o[g]||_1`` of each stored value, averaged over
    the query heads ``g`` of its KV group (one group member at a time, to bound memory)."""
    projection = view.output_projection
    batch, heads, slots, _ = view.values.shape
    groups = projection.shape[0] // heads
    weights = projection.view(heads, groups, *projection.shape[1:]).to(view.values.device, torch.float32)
    values = view.values.float()
    total = torch.zeros(batch, heads, slots, dtype=torch.float32, device=values.device)
    for member in range(groups):
        total += torch.matmul(values, weights[:, member]).abs().sum(-1)
    return total / groups


def _top(scores: torch.Tensor, candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch, heads, slots]``: each head's ``counts`` best candidates by ``scores``."""
    order = rank_order(scores, candidates)
    rank = torch.arange(scores.shape[-1], device=scores.device)
    taken = (rank < counts.to(scores.device).unsqueeze(-1)) & candidates.gather(-1, order)
    return torch.zeros_like(candidates).scatter(-1, order, taken)
