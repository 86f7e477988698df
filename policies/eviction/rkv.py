"""R-KV: keep what recent queries attend to, less what repeats other kept keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlib.policies.eviction.h2o import protected_scores
from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


@register("rkv")
@dataclass
class RKV(Eviction):
    """R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning
    Models"): decode-time eviction for long generations, which repeat themselves. Each head keeps
    its ``window`` newest tokens; every older (context) token is scored
    ``mix * importance - (1 - mix) * redundancy``:

    - importance: the attention the layer's last ``window`` queries (kept across decode steps,
      ``recent_queries``) give it, each query's softmax taken over the context tokens only (the
      official code's softmax over the logits without the window), averaged over those queries,
      max-pooled along the stored (position-ordered) context tokens with a ``kernel``-wide window,
      and averaged over the query heads of its KV group;
    - redundancy: per head, its key's cosine similarity to the other stored keys of the head
      (``"mean"`` over them, as the official code, or their ``"max"``), turned into a
      distribution over the head's context tokens by a softmax. The mean is taken through the
      sum of the head's unit keys (``O(slots * head_dim)`` a call); the max needs every pair
      (``O(slots^2 * head_dim)``), which costs seconds a decode step on a CPU at 2k slots.

    The official code also spares, among near-duplicate keys (similarity above 0.5), the newest
    one from the redundancy penalty; that refinement is not reproduced here.

    The budget is the spec's int budget (tokens per head, held at every compaction); R-KV's
    buffer (compress once the cache holds budget + buffer tokens) is the cache's ``slack`` (or
    ``interval`` decode steps between compactions). A float budget compresses the prompt only.

    Args:
        window: recent tokens kept in every head and the queries that score the rest (alpha,
            tokens >= 1; the paper uses 8). Counts toward the budget.
        kernel: max-pooling width of the importance, in slots; odd (1: no pooling; the official
            code uses 7).
        mix: lambda, the weight of importance against redundancy, in [0, 1] (the paper: 0.1).
        redundancy: ``"mean"`` or ``"max"`` cosine similarity to the head's other keys.
    """

    window: int = 8
    kernel: int = 7
    mix: float = 0.1
    redundancy: Literal["mean", "max"] = "mean"
    needs: ClassVar[frozenset[str]] = frozenset({"recent_queries"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (tokens), got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd integer >= 1 (slots), got {self.kernel}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1] (the weight of importance), got {self.mix}")

    def observed_queries(self) -> int:
        return self.window

    def score(self, view: LayerView) -> torch.Tensor:
        """Mixed score of the context tokens; the window's own tokens above every such score."""
        newest = view.positions.amax(dim=-1, keepdim=True)
        context = view.valid & (view.positions <= newest - self.window)
        mixed = self.mix * self.importance(view, context) - (1.0 - self.mix) * self.redundancy_of(view, context)
        return protected_scores(mixed.masked_fill(~context, 0.0), view, recent=self.window)

    def importance(self, view: LayerView, context: torch.Tensor) -> torch.Tensor:
        """Float32 ``[batch, kv_heads, slots]``: pooled window attention over the context tokens (0 elsewhere)."""
        batch, heads, slots = view.valid.shape
        attention = view.recent_attention.float()
        groups = attention.shape[1] // heads
        seen = context.repeat_interleave(groups, dim=1).unsqueeze(2)
        within = attention * seen
        within = within / within.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        mean = within.mean(dim=2).masked_fill(~seen.squeeze(2), -torch.inf)
        pooled = F.max_pool1d(mean.reshape(-1, 1, slots), self.kernel, 1, self.kernel // 2).reshape(batch, heads, groups, slots)
        pooled = pooled.mean(dim=2)
        return torch.where(context, pooled, 0.0)

    def redundancy_of(self, view: LayerView, context: torch.Tensor) -> torch.Tensor:
        """Float32 ``[batch, kv_heads, slots]``: the softmax over each head's context tokens of their
        mean (or max) cosine similarity to the head's other valid keys (0 elsewhere)."""
        keys = view.keys.float()
        unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        valid = view.valid
        if self.redundancy == "mean":  # sum_{j != i} u_i . u_j = u_i . (sum_j u_j) - u_i . u_i: no slots x slots matrix
            total = (unit * valid.unsqueeze(-1)).sum(dim=-2, keepdim=True)
            own = (unit * unit).sum(-1) * valid
            others = valid.sum(-1, keepdim=True) - valid.to(torch.int64)
            per_token = ((unit * total).sum(-1) - own) / others.clamp(min=1)
        else:
            similarity = torch.matmul(unit, unit.transpose(-1, -2))
            slots = similarity.shape[-1]
            others = valid.unsqueeze(-2) & ~torch.eye(slots, dtype=torch.bool, device=similarity.device)
            per_token = similarity.masked_fill(~others, -torch.inf).amax(-1).nan_to_num(0.0, neginf=0.0)
        distribution = torch.softmax(per_token.masked_fill(~context, -torch.inf), dim=-1).nan_to_num(0.0)
        return torch.where(context, distribution, 0.0)
