"""Slot reuse: a compaction that drops few tokens of a head moves only the tokens it must.

A head keeping ``k`` of its ``n`` stored tokens has as many dropped slots below ``k`` (*holes*) as
kept tokens at slots ``>= k`` (*sources*). Filling the ``j``-th hole with the ``j``-th source (both
ascending) and shortening the head to ``k`` keeps exactly the same tokens, with their positions, and
moves no other token: a decode step that stores one token and evicts one moves at most one, wherever
the evicted token sat. The in-order alternative (:meth:`~kvlib.storage.store.paged_store.PagedStore.compact`'s
rewrite) moves every kept token after the first dropped one.

After a hole fill a head's slots are no longer in position order; every reader looks each slot's
position up (attention masks, kernels, ``kept_positions``), and the evictor hands order-dependent
policies a view in position order (see :attr:`~kvlib.policy.Eviction.order_free`).

Pure index arithmetic on CPU int64 tensors (no state, vectorized over batch and heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HoleFill:
    """Where each kept token goes when every head of a batch fills its holes.

    ``layout`` int64 ``[batch, heads, width]``: the old slot of each new slot, ``-1`` at and past
    the head's new length; ``moves`` int64 ``[batch, heads]``: tokens moved per head. The moves, one
    entry each, in (batch, head, slot) order: ``batch``, ``head``, ``hole`` (the slot written) and
    ``source`` (the slot read).
    """

    layout: torch.Tensor
    moves: torch.Tensor
    batch: torch.Tensor
    head: torch.Tensor
    hole: torch.Tensor
    source: torch.Tensor

    def only(self, heads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(batch, head, hole, source)`` of the moves of the heads ``heads`` (bool ``[batch, heads]``)."""
        chosen = heads[self.batch, self.head]
        return self.batch[chosen], self.head[chosen], self.hole[chosen], self.source[chosen]


def hole_fill(kept: torch.Tensor, lengths: torch.Tensor) -> HoleFill:
    """The hole fill of every head that keeps ``kept`` (int64 ``[batch, heads, width]``, each head's
    kept slots ascending, ``-1`` last, as :func:`~kvlib.storage.pools.page_indexing.sorted_keep` gives them) of
    its ``lengths [batch, heads]`` stored tokens."""
    batch, heads, width = kept.shape
    longest = int(lengths.max()) if lengths.numel() else 0
    new_lengths = (kept >= 0).sum(-1, keepdim=True)
    is_kept = torch.zeros(batch, heads, longest + 1, dtype=torch.bool)
    is_kept.scatter_(-1, torch.where(kept >= 0, kept, longest), True)  # -1 padding lands on the spare last slot
    is_kept = is_kept[..., :longest]
    below = torch.arange(longest) < new_lengths
    holes = below & ~is_kept
    b, h, hole = holes.nonzero(as_tuple=True)
    source = (~below & is_kept).nonzero(as_tuple=True)[2]  # as many per head as holes, in the same head order
    slot = torch.arange(width)
    layout = torch.where(slot < new_lengths, slot, -1)
    layout[b, h, hole] = source
    return HoleFill(layout, holes.sum(-1), b, h, hole, source)
