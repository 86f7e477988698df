"""Reads of the paged store: dense (through the read caches), positional, sparse, in place for
paged attention (with the next layer's prefetch), key bounds and page ranking. Nothing here
changes what the store holds (:class:`StoreReads`, a part of :class:`~kvlib.storage.store.paged_store.PagedStore`)."""

from __future__ import annotations

import torch

from kvlib.devices import outside_inference_mode
from kvlib.kernels.paged_attention import PagedLayer
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.store_sequences import SequenceIds
from kvlib.storage.store.store_state import StoreState


class StoreReads(StoreState):
    """The paged store's reads, each of one layer of a batch of sequences."""

    @outside_inference_mode
    def read(self, layer: int, seqs: SequenceIds, *, mirror: bool = True) -> LayerRead:
        """``seqs``' stored tokens of ``layer`` in dense form (see :class:`~kvlib.storage.layers.read_cache.LayerRead`).

        With the read cache on, the result is a view of the layer's dense read cache, which later
        appends extend in place: use it before the next change to the store. ``mirror=False``
        gathers without building a read cache (and keeps the layer's current one, for another batch).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        lengths = self.layers[layer].table.lengths[rows]
        cached = self.read_caches.read(layer, rows, lengths, lambda part, size: self._gather(layer, part, size), keep=mirror)
        if cached is not None:
            return cached
        workspace = self._gather(layer, rows, int(lengths.max()) if lengths.numel() else 0)
        self.peak_workspace = max(self.peak_workspace, sum(t.nbytes for t in workspace))
        return workspace

    def read_positions(self, layer: int, seqs: SequenceIds) -> LayerRead:
        """``seqs``' stored tokens of ``layer`` as :meth:`read` lays them out, without their keys
        and values: ``keys`` and ``values`` have no channels (``[batch, kv_heads, slots, 0]``);
        ``positions`` and ``valid`` are :meth:`read`'s. What an eviction policy that scores by
        positions and attention needs after a call that attended over the pages (8 bytes a token)."""
        layer = self._layer(layer)
        return self.layers[layer].read_positions(self._rows(seqs))

    @outside_inference_mode
    def paged_layer(self, layer: int, seqs: SequenceIds) -> PagedLayer | None:
        """``seqs``' tokens of ``layer`` where they lie, for attention straight over the pages
        (:mod:`~kvlib.kernels.paged_attention`; coded pages are decoded inside the kernel; a tiered pool stages only its off-device pages, see
        :meth:`~kvlib.storage.pools.formats.tiered_format.TieredPages.paged_layer`, and the next layer's are
        prefetched as for :meth:`read`); None when the layer's pool cannot give its pages in place
        (codecs without a page loader: use :meth:`read`). Valid until the next change to the store or the next hand-over
        of the layer's pages (:meth:`paged_layer`, :meth:`paged_selection`: a tiered pool restages)."""
        layer = self._layer(layer)
        table = self.layers[layer].table
        rows = self._rows(seqs)
        paged = self._pool_pages(layer, table.pages[rows], table.lengths[rows])
        if paged is not None:
            self._prefetch_following(layer, rows)
        return paged

    @outside_inference_mode
    def paged_selection(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor) -> PagedLayer | None:
        """Only the chosen pages of each (sequence, head) of ``layer``, where they lie, for
        attention straight over them: what :meth:`read_selected` reads, with no dense copy.

        ``page_index`` as for :meth:`read_selected` (indices into each head's block table, any
        order, ``-1`` for none). The returned block table lists each head's chosen pages in
        block-table order, so a chosen partly filled last page is listed last, and its length
        counts the tokens those pages hold. None where the pool cannot give its pages in place
        (use :meth:`read_selected`). Valid as :meth:`paged_layer`'s result is.
        """
        layer = self._layer(layer)
        pages, lengths = self.layers[layer].selected_pages(self._rows(seqs), page_index)
        return self._pool_pages(layer, pages, lengths)

    def _pool_pages(self, layer: int, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """The pool's :meth:`~kvlib.storage.pools.page_pool.PagePool.paged_layer`; what a tiered pool
        staged for it counts as a transient workspace (``peak_workspace``)."""
        pool = self.layers[layer].pool
        paged = pool.paged_layer(pages, lengths)
        self.peak_workspace = max(self.peak_workspace, pool.staged_bytes)
        return paged

    def _gather(self, layer: int, rows: torch.Tensor, size: int) -> LayerRead:
        """:meth:`~kvlib.storage.layers.layer_reads.LayerReads.gather` of ``rows`` with ``size`` slots a
        head, then the following layer's prefetch."""
        read = self.layers[layer].gather(rows, size)
        if self.layers[layer].pool.pages_in_use:  # pages were read (none from an empty pool)
            self._prefetch_following(layer, rows)
        return read

    def _prefetch_following(self, layer: int, rows: torch.Tensor) -> None:
        """With a prefetcher, start fetching the off-device pages of ``rows`` in the layer read
        after ``layer`` (the first after the last)."""
        if self.prefetcher is not None:
            following = (layer + 1) % self.num_layers
            pages = self.layers[following].table.pages[rows]
            self.layers[following].pool.prefetch(pages[pages >= 0], self.prefetcher)

    def key_bounds(self, layer: int, seqs: SequenceIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key summaries of every page of ``seqs`` in ``layer``, in block-table order:
        ``(key_min, key_max)``, each ``[batch, kv_heads, pages, head_dim]`` on the store's device
        (entries past a head's ``pages_used`` are meaningless), and ``pages_used`` int64
        ``[batch, kv_heads]`` on the CPU. Needs a store made with ``key_summaries=True``."""
        layer = self._layer(layer)
        return self.layers[layer].key_bounds(self._rows(seqs))

    @outside_inference_mode
    def read_selected(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor) -> LayerRead:
        """Only the chosen pages of each (sequence, head) of ``layer``, in dense form: a sparse read.

        ``page_index`` int64 ``[batch, kv_heads, k]`` (CPU) names pages by their index in each
        head's block table (``0 <= j < pages used``), ``-1`` for none. Returns a
        :class:`~kvlib.storage.layers.read_cache.LayerRead` of up to ``k * page_size`` slots per head: page ``i``
        of the selection fills slots ``[i * page_size, (i + 1) * page_size)``, slots past the
        head's length or of a ``-1`` entry are zero and invalid, and trailing slots invalid in
        every head are left out (a selection of every page reads what :meth:`read` does). Only the chosen pages are read (with a
        tiered pool, only chosen host pages are copied to the device); nothing moves or changes.
        """
        layer = self._layer(layer)
        return self.layers[layer].read_selected(self._rows(seqs), page_index)

    @outside_inference_mode
    def stored_positions(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Positions of the stored tokens of ``seqs``: int64 ``[batch, heads, longest]`` on the CPU,
        -1 past each head's length (read from the arena without touching keys or values)."""
        layer = self._layer(layer)
        return self.layers[layer].stored_positions(self._rows(seqs))

    @outside_inference_mode
    def rank_pages(self, layer: int, seqs: SequenceIds, token_scores: torch.Tensor) -> None:
        """Rank the pages of ``seqs`` in ``layer`` for the device tier by ``token_scores`` (float
        ``[batch, kv_heads, slots]``, aligned with :meth:`read`'s slots; ``-inf`` for tokens that
        should not count): a page scores its best stored token, a page shared by several heads the
        best over them. The best-scored pages in use then sit on the device (see
        :meth:`~kvlib.storage.pools.formats.tiered_format.TieredPages.rank`). Needs a tiered store."""
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pool = self.layers[layer].pool
        if pool.device_pages is None:
            raise ValueError("rank_pages needs a tiered store (device_pages=...)")
        pool.rank(*self.layers[layer].page_scores(rows, token_scores))
