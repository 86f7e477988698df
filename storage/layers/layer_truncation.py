"""Truncation of one layer of the paged store: forget every stored token from a position on
(rolling back rejected draft tokens), reopening a last page the truncation ends inside when the
pool may not write it in place: :class:`LayerTruncation`, a part of
:class:`~kvlib.storage.layers.layer_pages.LayerPages`."""

from __future__ import annotations

import torch

from kvlib.errors import PoolExhaustedError
from kvlib.storage.layers.layer_reads import LayerReads


class LayerTruncation(LayerReads):
    """Truncation of one layer to a position, reopening last pages the pool may not write in place."""

    def truncate(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """Forget every stored token of ``rows`` whose position is ``>= length`` and cap their logical
        lengths at ``length``; returns the new stored lengths, int64 ``[batch, kv_heads]``.

        The tokens dropped must be a suffix of each head; otherwise ``ValueError`` and nothing
        changes (as when a fixed pool lacks the pages to reopen: ``PoolExhaustedError``). No token
        moves: pages past the new end are released, a partly kept page stays as it is unless the
        pool reopens it (:meth:`_pages_to_reopen`).
        """
        layer, pool, table = self.layer, self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        positions = self.stored_positions(rows)
        slot = torch.arange(positions.shape[-1])
        stored = slot < lengths.unsqueeze(-1)
        kept = stored & (positions < length)
        new_lengths = kept.sum(-1)
        if not bool((kept == (slot < new_lengths.unsqueeze(-1))).all()):
            raise ValueError(f"layer {layer}: tokens at positions >= {length} are not a suffix of every head")
        page_slot = torch.arange(table.pages.shape[2])
        drop = (page_slot >= table.pages_used(new_lengths).unsqueeze(-1)) & (page_slot < table.pages_used(lengths).unsqueeze(-1))
        dropped = table.pages[rows][drop]
        reopen = self._pages_to_reopen(rows, new_lengths)
        if reopen is not None:
            unique, counts = torch.unique(dropped, return_counts=True)
            freed = int((pool.refcount[unique] == counts).sum())
            if not pool.can_allocate(int(reopen.sum()) - freed):
                raise PoolExhaustedError(
                    f"layer {layer}: truncation needs {int(reopen.sum())} pages to reopen, {pool.free_pages + freed} free"
                )
        pool.decref(dropped)
        b, h, j = drop.nonzero(as_tuple=True)
        table.pages[rows[b], h, j] = -1
        table.lengths[rows] = new_lengths
        table.logical[rows] = table.logical[rows].clamp(max=length)
        table.sealed[rows] = table.sealed[rows].clamp(max=new_lengths // page_size)
        if reopen is not None:
            self._reopen(rows, reopen)
        if pool.summaries is not None:
            self._resummarize_last_pages(rows, new_lengths != lengths)
        return new_lengths

    def _pages_to_reopen(self, rows: torch.Tensor, new_lengths: torch.Tensor) -> torch.Tensor | None:
        """bool ``[batch, heads]``: heads a truncation to ``new_lengths`` leaves in the middle of a
        page the pool may not write in place (sealed or shared), for a pool that reopens such pages
        (:attr:`~kvlib.storage.pools.page_pool.PagePool.reopens_partial_pages`; else None). Such a head
        gets an open, private copy of that page, so that appends can write after it, a sharer for
        which the page is still full may seal it without sealing a partial page, and the copy's key
        summary covers only the tokens its head holds."""
        pool, table = self.pool, self.table
        if not pool.reopens_partial_pages:
            return None
        partial = new_lengths % pool.page_size != 0
        last_index = torch.where(partial, new_lengths // pool.page_size, 0)
        last = table.pages[rows].gather(2, last_index.unsqueeze(-1)).squeeze(-1)
        partial[partial.clone()] = ~pool.writable(last[partial])
        return partial

    def _reopen(self, rows: torch.Tensor, reopen: torch.Tensor) -> None:
        """Replace the last page of each head in ``reopen`` by an open, private copy (see
        :meth:`_pages_to_reopen`; a summarized pool's copy has its summary redone by the truncation)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        b, h = reopen.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        old = table.pages[rows[b], h, lengths[b, h] // page_size]
        new = pool.allocate(b.numel(), h)
        pool.open_copies(old, new)
        pool.decref(old)
        table.pages[rows[b], h, lengths[b, h] // page_size] = new

    def _resummarize_last_pages(self, rows: torch.Tensor, changed: torch.Tensor) -> None:
        """Recompute the key summaries of the partly filled last pages of the heads ``changed``
        (bool ``[batch, heads]``) from the tokens they still hold (after a truncation; such pages
        are private by then, see :meth:`_pages_to_reopen`)."""
        pool, table = self.pool, self.table
        page_size = pool.page_size
        lengths = table.lengths[rows]
        partial = changed & (lengths % page_size != 0)
        b, h = partial.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        ids = table.pages[rows[b], h, lengths[b, h] // page_size]
        keys, _ = pool.read_pages(ids)
        pool.summaries.recompute(ids, keys, lengths[b, h] % page_size)
