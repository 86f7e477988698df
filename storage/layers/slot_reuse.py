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

Pure index arithmetic on int64 numpy arrays (no state, vectorized over batch and heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HoleFill:
    """Where each kept token goes when every head of a batch fills its holes.

    ``layout`` int64 ``[batch, heads, width]``: the old slot of each new slot, ``-1`` at and past
    the head's new length; ``moves`` int64 ``[batch, heads]``: tokens moved per head. The moves, one
    entry each, in (batch, head, slot) order: ``batch``, ``head``, ``hole`` (the slot written) and
    ``source`` (the slot read).
    """

    layout: np.ndarray
    moves: np.ndarray
    batch: np.ndarray
    head: np.ndarray
    hole: np.ndarray
    source: np.ndarray

    def only(self, heads: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(batch, head, hole, source)`` of the moves of the heads ``heads`` (bool ``[batch, heads]``)."""
        chosen = heads[self.batch, self.head]
        return self.batch[chosen], self.head[chosen], self.hole[chosen], self.source[chosen]


def hole_fill(kept: np.ndarray, lengths: np.ndarray) -> HoleFill:
    """The hole fill of every head that keeps ``kept`` (int64 ``[batch, heads, width]``, each head's
    kept slots ascending, ``-1`` last, as :func:`~kvlib.storage.pools.page_indexing.sorted_keep` gives them) of
    its ``lengths [batch, heads]`` stored tokens."""
    batch, heads, width = kept.shape
    longest = int(lengths.max()) if lengths.size else 0
    new_lengths = (kept >= 0).sum(-1, keepdims=True)
    is_kept = np.zeros((batch, heads, longest + 1), dtype=bool)
    np.put_along_axis(is_kept, np.where(kept >= 0, kept, longest), True, axis=-1)  # -1 padding lands on the spare last slot
    is_kept = is_kept[..., :longest]
    below = np.arange(longest) < new_lengths
    holes = below & ~is_kept
    b, h, hole = np.nonzero(holes)
    source = np.nonzero(~below & is_kept)[2]  # as many per head as holes, in the same head order
    slot = np.arange(width)
    layout = np.where(slot < new_lengths, slot, -1)
    layout[b, h, hole] = source
    return HoleFill(layout, holes.sum(-1), b, h, hole, source)
