"""GraphKV: an inner policy's scores lowered for tokens whose keys repeat those of kept tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, EvictionWrapper, LayerView, WithInner
from kvlib.registry import register
from kvlib.selection import rank_order

_OWN_NEEDS = frozenset({"budget"})


@register("graphkv")
@dataclass
class GraphKV(EvictionWrapper):
    """GraphKV (Li, Jin and Zhang, 2025, "GraphKV: Breaking the Static Selection Paradigm with
    Graph-Based KV Cache Eviction", EMNLP 2025, arXiv:2509.00388): tokens are the nodes of a graph
    whose edges are the cosine similarities of their keys; the most important nodes are kept first
    and send a decay signal along their edges, so tokens redundant with what is kept lose score
    and moderately important but different tokens take their place.

    Per (row, KV head), on the ``inner`` policy's scores (default SnapKV, the paper's base):

    1. each round takes as *sources* the ``m`` best-scored candidates that are not sources yet,
       ``m = max(1, min(sources, budget // rounds))`` (``budget``: the call's tokens per head;
       without one, the head's candidates), so every source lies within what the head keeps;
    2. each source ``i`` sends its signal to its ``neighbors`` nearest non-source tokens ``j``
       (largest cosine similarity of keys; the sparse graph that keeps the cost linear in the
       tokens), of strength ``e_ij = decay * max(0, cos(k_i, k_j))``;
    3. a receiving token keeps ``f_j = prod_i (1 - e_ij)`` of its score's magnitude:
       ``s_j <- s_j - (1 - f_j) * |s_j|`` (for ``s_j >= 0`` that is ``s_j * f_j``; a negative
       score goes further down), so a token only ever loses score, and a duplicate of a source's
       key (``cos = 1``, ``decay = 1``) loses all of it.

    The paper gives the graph, the propagation from the top-K nodes to their most similar
    neighbours, and repeated rounds (one round gives most of the gain); the multiplicative update
    and ``m`` tied to the budget are this implementation's reading of it (the stored paper text
    holds no formula; its code was not released when this was written).

    Invariants: sources keep their inner score, and since other scores only go down, every source
    still outranks every token it decayed; the inner's non-finite scores (SnapKV's window ``+inf``,
    ``-inf``) pass through unchanged and never receive a signal (``+inf`` tokens do send one: they
    are kept); invalid slots score ``-inf``. With ``decay = 0`` the scores are the inner's.

    Args:
        inner: the importance scorer (an eviction policy or its spec string; default SnapKV).
        sources: most tokens per head that become sources in one round (tokens >= 1).
        neighbors: edges per source, its most similar tokens (>= 1; 0: every token).
        decay: signal strength per unit of cosine similarity, in [0, 1].
        rounds: propagation rounds (>= 1).
    """

    inner: Eviction = field(default_factory=SnapKV)
    sources: int = 64
    neighbors: int = 16
    decay: float = 1.0
    rounds: int = 1
    needs = WithInner(_OWN_NEEDS, frozenset.union)
    reads_kv: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sources < 1:
            raise ValueError(f"sources must be >= 1 (tokens per head and round), got {self.sources}")
        if self.neighbors < 0:
            raise ValueError(f"neighbors must be >= 0 (edges per source; 0: every token), got {self.neighbors}")
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1] (signal per unit of cosine similarity), got {self.decay}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")

    def score(self, view: LayerView) -> torch.Tensor:
        """The inner scores, decayed by similarity to each round's sources; invalid ``-inf``."""
        scores = torch.where(view.valid, self.inner.score(view).float(), -torch.inf)
        candidates = view.valid & (scores > -torch.inf)
        counts = candidates.sum(-1)
        budget = counts if view.budget_tokens is None else view.budget_tokens.to(counts.device).view(-1, 1).expand_as(counts)
        per_round = (budget // self.rounds).clamp(min=1, max=self.sources)
        unit_keys = F.normalize(view.keys.float(), dim=-1)
        is_source = torch.zeros_like(candidates)
        rank = torch.arange(scores.shape[-1], device=scores.device)
        for _ in range(self.rounds):
            open_candidates = candidates & ~is_source
            order = rank_order(scores, open_candidates)
            most = int(per_round.max()) if per_round.numel() else 0
            if most == 0:
                break
            chosen = (rank[:most] < per_round.unsqueeze(-1)) & open_candidates.gather(-1, order[..., :most])  # [b, h, m]
            is_source = is_source | torch.zeros_like(candidates).scatter(-1, order[..., :most], chosen)
            receivers = candidates & ~is_source & scores.isfinite()
            similarity = self._edges(unit_keys, order[..., :most], chosen, receivers)  # [b, h, slots, m]
            kept_share = (1.0 - self.decay * similarity).prod(-1)
            scores = torch.where(receivers, scores - (1.0 - kept_share) * scores.abs(), scores)
        return torch.where(view.valid, scores, -torch.inf)

    def _edges(self, unit_keys: torch.Tensor, source_slots: torch.Tensor, chosen: torch.Tensor, receivers: torch.Tensor) -> torch.Tensor:
        """float32 ``[batch, kv_heads, slots, m]``: the edge weight ``max(0, cos)`` from each chosen
        source to each receiver among its ``neighbors`` most similar receivers, 0 elsewhere."""
        dim = unit_keys.shape[-1]
        source_keys = unit_keys.gather(2, source_slots.unsqueeze(-1).expand(-1, -1, -1, dim))
        similarity = torch.matmul(unit_keys, source_keys.transpose(-1, -2)).clamp(min=0.0)
        similarity = similarity.masked_fill(~receivers.unsqueeze(-1), 0.0).masked_fill(~chosen.unsqueeze(-2), 0.0)
        slots = similarity.shape[2]
        if 0 < self.neighbors < slots:
            nearest = similarity.topk(self.neighbors, dim=2).indices
            edges = torch.zeros_like(similarity, dtype=torch.bool).scatter(2, nearest, True)
            similarity = similarity.masked_fill(~edges, 0.0)
        return similarity
