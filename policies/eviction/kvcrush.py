"""KVCrush: part of the budget keeps one representative per group of pruned tokens that behave alike across heads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, EvictionWrapper, LayerView, WithInner
from kvlib.registry import register
from kvlib.selection import rank_order

_OWN_NEEDS = frozenset({"attention", "budget"})
_RANDOM_ANCHOR_STREAM = 1_000_003
"""Multiplies the seed before the layer index is added: each layer's random anchor its own draw."""


@register("kvcrush")
@dataclass
class KVCrush(EvictionWrapper):
    """KVCrush (Jha, Gobriel, Talamanova and Jain, 2025, "KVCrush: Key Value Cache size-reduction
    using similarity in head-behaviour", ACML 2025, arXiv:2503.00022): an add-on to another
    eviction. The ``inner`` policy keeps its best tokens with most of each head's budget; the
    rest (``share`` of it) goes to representatives of the tokens the inner prunes, so that
    groups of tokens the inner drops entirely still have one token each in the cache.

    Per layer call with a budget of ``B`` tokens per head (the call's budget; each head's own cap
    under the allocation is what the engine keeps, so an allocation other than uniform keeps the
    best ``cap`` of the order below):

    1. *Signature*: each token is an ``H``-bit vector, one bit per query head of the layer: 1 when
       the token is among the upper half (``floor(n / 2)`` of the ``n`` tokens stored for that
       head's KV group) by the attention the head's last ``window`` queries give it, as the
       released implementation (OpenVINO GenAI's ``KVCrushAlgorithm``) marks its top half. A KV
       head's token finds each query head's bit by position, so heads that have evicted
       differently still agree on which token is which; a token a KV group no longer holds has
       bit 0 there.
    2. The inner keeps its ``B - R`` best tokens, ``R = floor(share * B)``; the other candidates
       are the pruned tokens.
    3. *Grouping*: the pruned tokens of each (row, KV head) are sorted by the Hamming distance of
       their signature to an ``anchor`` (ties: earlier slot first), and ``R`` of them are taken
       evenly spaced along that order (indices ``i * (P // R)`` of the ``P`` pruned, as the
       released code takes its blocks): one representative per run of alike tokens.

    The returned scores are ranks, not attention: the inner's ``B - R`` first (in the inner's
    order), then the representatives, then the other tokens in the inner's order; invalid slots
    and the inner's ``-inf`` are ``-inf``. An allocation that compares scores across heads
    (``adaptive``) therefore sees every head alike. Where the call compacts nothing (a codec's
    salience) the scores are the inner's.

    Args:
        inner: the eviction policy it completes (an eviction policy or its spec string;
            default SnapKV, one of the paper's bases).
        share: the fraction of each head's budget spent on representatives, in [0, 1) (0: the
            inner alone).
        window: the last queries of a call whose attention makes the signatures (>= 1); with an
            inner that observes fewer, as many as it observes.
        anchor: the reference signature: ``"random"`` (the released default; bits drawn from
            ``seed`` and the layer index, the same in every call), ``"zeros"``, ``"ones"``,
            ``"alternate"`` (0, 1, 0, ...), or ``"mean"`` (each bit the majority among the
            head's pruned tokens).
        seed: seed of the random anchor.
    """

    inner: Eviction = field(default_factory=SnapKV)
    share: float = 0.25
    window: int = 32
    anchor: Literal["random", "zeros", "ones", "alternate", "mean"] = "random"
    seed: int = 0
    needs = WithInner(_OWN_NEEDS, frozenset.union)
    reads_kv = WithInner(False, lambda own, inner: inner)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"share must be in [0, 1) (the fraction of the budget for representatives), got {self.share}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (queries), got {self.window}")

    def observed_queries(self) -> int | None:
        return self.inner.observed_queries() if "attention" in self.inner.needs else self.window

    def score(self, view: LayerView) -> torch.Tensor:
        """Ranks: the inner's kept share, then the representatives, then the rest; invalid ``-inf``."""
        inner = torch.where(view.valid, self.inner.score(view).float(), -torch.inf)
        if view.budget_tokens is None:
            return inner
        candidates = view.valid & (inner > -torch.inf)
        slots = inner.shape[-1]
        slot = torch.arange(slots, device=inner.device)
        rank = torch.empty_like(slot.expand_as(inner)).scatter_(-1, rank_order(inner, candidates), slot.expand_as(inner))
        budget = view.budget_tokens.to(inner.device).view(-1, 1, 1)
        represent = (budget.to(torch.float64) * self.share).floor().to(torch.int64)
        kept = candidates & (rank < budget - represent)
        pruned = candidates & ~kept
        signatures = self.signatures(view)
        distance = (signatures != self._anchor(signatures, pruned, view.layer_idx)).sum(-1)
        by_distance = torch.where(pruned, distance * slots + slot, (signatures.shape[-1] + 1) * slots + slot).argsort(-1)
        count = pruned.sum(-1, keepdim=True)
        taken = torch.minimum(represent.expand_as(count), count)
        step = count // taken.clamp(min=1)
        pick = slot.view(1, 1, -1) * step
        chosen = (slot.view(1, 1, -1) < taken) & (pick < count)
        representatives = torch.zeros_like(pruned).scatter(-1, by_distance.gather(-1, pick.clamp(max=slots - 1)), chosen)
        tier = kept.to(torch.int64) * 2 + representatives.to(torch.int64)
        return torch.where(candidates, (tier * slots + slots - rank).float(), -torch.inf)

    def signatures(self, view: LayerView) -> torch.Tensor:
        """Bool ``[batch, kv_heads, slots, query_heads]``: each stored token's bit per query head
        (in the upper half of that head's tokens by the last ``window`` queries' attention)."""
        batch, heads, slots = view.valid.shape
        received = view.attention[:, :, -self.window :, :].float().sum(2)  # [batch, query_heads, slots]
        query_heads = received.shape[1]
        group = query_heads // heads
        held = view.valid.repeat_interleave(group, dim=1)
        slot = torch.arange(slots, device=received.device)
        rank = torch.empty_like(slot.expand_as(received)).scatter_(-1, rank_order(received, held), slot.expand_as(received))
        upper = held & (rank < held.sum(-1, keepdim=True) // 2)
        positions = torch.where(view.valid, view.positions, -1)
        width = int(positions.max()) + 2 if positions.numel() else 1
        at = torch.where(positions >= 0, positions, width - 1)  # the last column: no position
        table = torch.zeros(batch, query_heads, width, dtype=torch.bool, device=received.device)
        table.scatter_(-1, at.repeat_interleave(group, dim=1), upper)
        table[..., -1] = False
        bits = table.gather(-1, at.view(batch, 1, heads * slots).expand(-1, query_heads, -1))
        return bits.view(batch, query_heads, heads, slots).permute(0, 2, 3, 1)

    def _anchor(self, signatures: torch.Tensor, pruned: torch.Tensor, layer: int) -> torch.Tensor:
        """Bool ``[batch, kv_heads, 1, query_heads]``: the signature distances are measured from."""
        batch, heads, _, bits = signatures.shape
        if self.anchor == "mean":
            votes = (signatures & pruned.unsqueeze(-1)).sum(2, keepdim=True)
            return votes * 2 > pruned.sum(-1).view(batch, heads, 1, 1)
        if self.anchor == "random":
            generator = torch.Generator().manual_seed(self.seed * _RANDOM_ANCHOR_STREAM + layer)
            row = torch.randint(0, 2, (bits,), generator=generator).bool()
        elif self.anchor == "alternate":
            row = torch.arange(bits) % 2 == 1
        else:
            row = torch.full((bits,), self.anchor == "ones")
        return row.to(signatures.device).view(1, 1, 1, bits).expand(batch, heads, 1, bits)
