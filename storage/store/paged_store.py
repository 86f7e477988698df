"""The paged KV store: per-layer page pools, block tables, positions, fork and compaction.

A *sequence* is an integer id (a row of every layer's :class:`~kvlib.storage.layers.block_table.BlockTable`).
Each layer has its own :class:`~kvlib.storage.PagePool`; a head's tokens sit in its own pages, so
heads may keep different numbers of tokens and the pages they drop are really freed.

The store is one class: its state (the layers, read caches and sequence ids; lengths and bytes
held), its reads (dense through the read caches, positional, sparse, in place for paged
attention, key bounds, page ranking) and the calls that change it (sequences, writes, planned
steps, compaction, truncation, sealing). Each layer is a
:class:`~kvlib.storage.layers.layer_pages.LayerPages` (``store.layers[layer]``): its pool, block table
and positions, with the operations on them as methods (writes, reads, compaction, truncation,
sealing, room for planned steps); the store checks the arguments and delegates. The read caches
are a :class:`~kvlib.storage.store.read_caches.ReadCaches`, the sequence ids a
:class:`~kvlib.storage.store.store_sequences.SequenceRows`, the pools come from
:func:`~kvlib.storage.store.pool_factory.build_pools` and a :class:`~kvlib.storage.store.store_config.StoreConfig`.

Invariants (after every public call; ``tests/storage/store/test_store_state_machine.py`` checks them):

- a page's reference count equals the number of block-table entries, over all live sequences,
  that name it; free pages are referenced by no table;
- reading a sequence returns the tokens appended minus those compacted away, with their
  original positions, in slot order: the order of appends, except where a compaction reused
  slots (:meth:`PagedStore.compact` fills dropped slots with later kept tokens and returns the
  layout: where each kept token went). Slot order is therefore not position order after a
  decode-step eviction; readers use the stored positions;
- pages referenced more than once are never written: appends copy a shared open page first
  (copy-on-write), compaction writes kept tokens to fresh pages, or into pages that this head
  alone holds and that are not sealed;
- a call that fails validation (or finds a fixed pool too small) changes nothing;
- with codecs, a sealed page is full and immutable; pages are sealed only by :meth:`seal`
  (the transformers cache calls it after each layer's attention), so a call's attention always
  sees its own new tokens exact;
- once no sequence is live, the read caches and block tables are back to a new store's sizes
  (what grew with a batch does not stay at its high-water mark);
- a growable arena that a compaction or a release leaves less than half in use shrinks to
  :func:`~kvlib.storage.pools.page_pool.grown` of its pages in use (pages move down, the block tables follow), unless something
  besides this store's tables (a prefix index) holds pages of it.

All operations are vectorized over batch and heads: no Python loop runs per token or per head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvlib.devices import outside_inference_mode
from kvlib.kernels.pages import PagedLayer
from kvlib.storage.layers.block_table import BlockTable
from kvlib.storage.layers.layer_pages import LayerPages
from kvlib.storage.layers.open_pages import OpenPages
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.store.pool_factory import build_pools
from kvlib.storage.store.read_caches import ReadCaches
from kvlib.storage.store.step_plan import DecodeLayout, Ring, StepPlan, build_layout
from kvlib.storage.store.store_config import StoreConfig
from kvlib.storage.store.store_sequences import SequenceIds, SequenceRows
from kvlib.storage.tiers.spill_store import SpilledPageLost, SpillStore

Read = TypeVar("Read")
"""What a selection read returns (pages in place, or a dense copy)."""


class PagedStore:
    """Paged KV store for the attention layers of one model.

    Args:
        config: what the store holds and where (shapes, page size, capacity, codecs, tiers);
            see :class:`~kvlib.storage.store.store_config.StoreConfig`. What the arenas take up front must fit
            in the memory its device has available, else ``ValueError`` before anything is
            allocated.
        spill: a :class:`~kvlib.storage.tiers.spill_store.SpillStore` taking, with ``host_pages``, the
            host pages written longest ago once the host is full, at most ``disk_pages`` pages of
            each layer (the store owns its pages' records: freeing a page deletes its record).
        prefetcher: with ``device_pages``, each read of a layer starts fetching the host and disk
            pages of the same sequences in the layer read next (the first after the last, for
            the next decode step) on this :class:`~kvlib.storage.pools.page_prefetch.PagePrefetcher`'s
            background thread (a copy stream on CUDA); the next read of that layer takes them. A
            layer whose last read was a selection (:meth:`paged_selection`, :meth:`read_selected`:
            page retrieval's sparse steps) is not fetched whole; its caller fetches the pages it
            expects to read next instead (:meth:`prefetch_selection`). Reads return the same with
            or without it. None: no prefetch.
    """

    # -- state: layers, read caches, sequence ids; lengths and bytes ----------------------------

    @outside_inference_mode
    def __init__(self, config: StoreConfig, *, spill: SpillStore | None = None, prefetcher: PagePrefetcher | None = None) -> None:
        self.config = config
        self.num_layers = config.num_layers
        self.page_size = config.page_size
        self.dtype = config.dtype
        self.device: torch.device = config.device
        if prefetcher is not None and config.device_pages is None:
            raise ValueError("prefetch fetches pages off the device ahead of their read: give device_pages (tiering) too")
        pools = build_pools(config, spill=spill)
        self.layers = [
            LayerPages(layer, pool, BlockTable(heads, self.page_size)) for layer, (pool, heads) in enumerate(zip(pools, config.layer_heads))
        ]
        """Per layer, its pages: pool, block table and positions (:class:`~kvlib.storage.layers.layer_pages.LayerPages`)."""
        self.prefetcher = prefetcher
        self._read_by_selection = [False] * self.num_layers
        """Per layer, whether its last read was a selection (then a read of the layer before does
        not prefetch it whole: :meth:`_prefetch_following`)."""
        self.read_caches = ReadCaches(self.num_layers, self.page_size, config.read_cache)
        """Per layer, the dense read cache of the last batch read (if ``config.read_cache``)."""
        self._layout: DecodeLayout | None = None
        """Where the planned decode steps of the last planned batch go (:meth:`plan_step`);
        dropped by every change to the store other than a planned write."""
        self._ids = SequenceRows()
        self.peak_page_bytes = 0
        """High-water mark of ``memory_bytes()["pages"]`` (updated whenever an append allocates pages)."""
        self.peak_workspace = 0
        """The most bytes one dense read not kept as a read cache has taken (a transient workspace a
        multi-token call attends over, freed when the call returns)."""
        self.lost_pages_missed = 0
        """Chosen pages a selection read left out because their spilled record was lost (``lost="miss"``)."""

    @property
    def pools(self) -> list[PagePool]:
        """Each layer's page pool (:attr:`LayerPages.pool <kvlib.storage.layers.layer_pages.LayerPages.pool>`)."""
        return [pages.pool for pages in self.layers]

    @property
    def tables(self) -> list[BlockTable]:
        """Each layer's block table (:attr:`LayerPages.table <kvlib.storage.layers.layer_pages.LayerPages.table>`)."""
        return [pages.table for pages in self.layers]

    @property
    def use_read_cache(self) -> bool:
        """Whether reads build dense read caches (``config.read_cache``)."""
        return self.read_caches.enabled

    def mirrored_rows(self, layer: int) -> tuple[int, ...]:
        """The sequences ``layer``'s read cache holds, in its row order (empty without one): a
        batch that starts with them in this order reads without regathering."""
        return self.read_caches.rows(self._layer(layer))

    def logical_lengths(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Tokens each sequence has seen in ``layer``: int64 ``[batch]`` (a copy)."""
        return self.layers[self._layer(layer)].table.logical[self._rows(seqs)]

    def physical_lengths(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Tokens stored per head in ``layer``: int64 ``[batch, kv_heads]`` (a copy)."""
        return self.layers[self._layer(layer)].table.lengths[self._rows(seqs)]

    # -- memory --------------------------------------------------------------------------------

    def bytes_in_use(self) -> int:
        """Bytes held by pages in use across all layers (keys, values, positions)."""
        return sum(pages.pool.bytes_in_use() for pages in self.layers)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held, by component: ``pages`` (keys and values of pages in use: compute dtype for
        open pages, the codec's payload for sealed ones; on every tier), ``host`` and ``disk``
        (the parts of ``pages`` held in host memory and spilled to disk), ``positions``,
        ``codec_metadata`` (scales, zero points and fitted codec state), ``key_summaries`` (the key
        minima and maxima of pages in use, on the device: page retrieval), ``tables`` (block tables
        and lengths), ``read_cache`` (dense read caches) and ``reserved`` (whole arenas, free pages included)."""
        tiers = [pool.tier_bytes() for pool in self.pools]
        return {
            "pages": self._page_bytes(),
            "positions": sum(pool.pages_in_use * pool.position_page_bytes for pool in self.pools),
            "codec_metadata": sum(pool.metadata_bytes() for pool in self.pools),
            "key_summaries": sum(pool.pages_in_use * pool.summaries.page_bytes for pool in self.pools if pool.summaries is not None),
            "host": sum(tier["host"] for tier in tiers),
            "disk": sum(tier["disk"] for tier in tiers),
            "tables": sum(pages.table_bytes() for pages in self.layers),
            "read_cache": self.read_caches.nbytes(),
            "reserved": sum(pool.bytes_reserved() for pool in self.pools),
        }

    def _page_bytes(self) -> int:
        """Bytes of keys and values of the pages in use, over all layers (``memory_bytes()["pages"]``)."""
        return sum(pages.pool.data_bytes() for pages in self.layers)

    def _changed(self, layer: int | None = None) -> None:
        """``layer``'s block tables or pages (every layer's, for None) changed other than by a
        planned write: where appends go next is worked out again."""
        for pages in self.layers if layer is None else [self.layers[layer]]:
            pages.open_pages = None
        self._layout = None

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def _rows(self, seqs: SequenceIds) -> torch.Tensor:
        return self._ids.rows(seqs)

    # -- reads ---------------------------------------------------------------------------------

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
            self._read_by_selection[layer] = False
            self._prefetch_following(layer, rows)
        return paged

    @outside_inference_mode
    def paged_selection(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor, *, lost: str = "raise") -> PagedLayer | None:
        """Only the chosen pages of each (sequence, head) of ``layer``, where they lie, for
        attention straight over them: what :meth:`read_selected` reads, with no dense copy.

        ``page_index`` as for :meth:`read_selected` (indices into each head's block table, any
        order, ``-1`` for none). The returned block table lists each head's chosen pages in
        block-table order, so a chosen partly filled last page is listed last, and its length
        counts the tokens those pages hold. None where the pool cannot give its pages in place
        (use :meth:`read_selected`). Valid as :meth:`paged_layer`'s result is. ``lost`` as for
        :meth:`read_selected`.
        """
        layer, rows = self._layer(layer), self._rows(seqs)

        def select(index: torch.Tensor) -> PagedLayer | None:
            return self._pool_pages(layer, *self.layers[layer].selected_pages(rows, index))

        self._read_by_selection[layer] = True
        return self._missing_lost(layer, rows, page_index, lost, select)

    def prefetch_selection(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor) -> None:
        """With a prefetcher, start fetching the host and disk pages among the chosen pages of
        ``seqs`` in ``layer`` (``page_index`` as for :meth:`read_selected`) for the layer's next
        read, replacing a prefetch of the layer not read yet: what a sparse step expects its next
        step to read (:meth:`~kvlib.policy.PageRetrieval.expected_pages`). Without one, nothing.
        The read returns the same either way."""
        if self.prefetcher is None:
            return
        layer, rows = self._layer(layer), self._rows(seqs)
        pages, _ = self.layers[layer].selected_pages(rows, page_index)
        self.layers[layer].pool.prefetch(pages[pages >= 0], self.prefetcher)

    def _pool_pages(self, layer: int, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """The pool's :meth:`~kvlib.storage.pools.page_pool.PagePool.paged_layer`; what a tiered pool
        staged for it counts as a transient workspace (``peak_workspace``)."""
        pool = self.layers[layer].pool
        paged = pool.paged_layer(pages, lengths)
        self.peak_workspace = max(self.peak_workspace, pool.staged_bytes)
        return paged

    def _gather(self, layer: int, rows: torch.Tensor, size: int) -> LayerRead:
        """:meth:`~kvlib.storage.layers.layer_pages.LayerPages.gather` of ``rows`` with ``size`` slots a
        head, then the following layer's prefetch."""
        read = self.layers[layer].gather(rows, size)
        if self.layers[layer].pool.pages_in_use:  # pages were read (none from an empty pool)
            self._read_by_selection[layer] = False
            self._prefetch_following(layer, rows)
        return read

    def _prefetch_following(self, layer: int, rows: torch.Tensor) -> None:
        """With a prefetcher, start fetching the off-device pages of ``rows`` in the layer read
        after ``layer`` (the first after the last), unless that layer's last read was a selection."""
        following = (layer + 1) % self.num_layers
        if self.prefetcher is not None and not self._read_by_selection[following]:
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
    def read_selected(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor, *, lost: str = "raise") -> LayerRead:
        """Only the chosen pages of each (sequence, head) of ``layer``, in dense form: a sparse read.

        ``page_index`` int64 ``[batch, kv_heads, k]`` (CPU) names pages by their index in each
        head's block table (``0 <= j < pages used``), ``-1`` for none. Returns a
        :class:`~kvlib.storage.layers.read_cache.LayerRead` of up to ``k * page_size`` slots per head: page ``i``
        of the selection fills slots ``[i * page_size, (i + 1) * page_size)``, slots past the
        head's length or of a ``-1`` entry are zero and invalid, and trailing slots invalid in
        every head are left out (a selection of every page reads what :meth:`read` does). Only the chosen pages are read (with a
        tiered pool, only chosen host pages are copied to the device); nothing moves or changes.

        ``lost``: what a chosen page whose spilled record is lost does (:class:`~kvlib.storage.tiers.spill_store.SpilledPageLost`):
        ``"raise"`` (the default: the record held the only copy), or ``"miss"``: it is left out of
        the selection, as if not chosen (a selection is approximate by design: page retrieval), and
        counted in :attr:`lost_pages_missed`. A file lost whole (no page named) raises either way.
        """
        layer, rows = self._layer(layer), self._rows(seqs)
        self._read_by_selection[layer] = True
        return self._missing_lost(layer, rows, page_index, lost, lambda index: self.layers[layer].read_selected(rows, index))

    def _missing_lost(
        self, layer: int, rows: torch.Tensor, page_index: torch.Tensor, lost: str, read: Callable[[torch.Tensor], Read]
    ) -> Read:
        """``read(page_index)``; with ``lost="miss"``, again without the chosen pages each
        :class:`~kvlib.storage.tiers.spill_store.SpilledPageLost` names, until it reads."""
        if lost not in ("raise", "miss"):
            raise ValueError(f"lost must be 'raise' or 'miss', got {lost!r}")
        while True:
            try:
                return read(page_index)
            except SpilledPageLost as error:
                chosen = self.layers[layer].table.pages[rows].gather(2, page_index.clamp(min=0))
                gone = (page_index >= 0) & torch.isin(chosen, torch.tensor(error.pages, dtype=chosen.dtype))
                if lost == "raise" or not bool(gone.any()):
                    raise
                self.lost_pages_missed += int(gone.sum())
                page_index = torch.where(gone, -1, page_index)

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

    # -- sequences -----------------------------------------------------------------------------

    @property
    def sequences(self) -> list[int]:
        """Live sequence ids, ascending."""
        return self._ids.live

    @outside_inference_mode
    def new_sequence(self) -> int:
        """Create an empty sequence and return its id."""
        row = self._ids.take()
        for pages in self.layers:
            pages.table.ensure_rows(self._ids.row_count)
        return row

    @outside_inference_mode
    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` by reference (copy-on-write on change)."""
        source = self._rows([seq])
        row = self.new_sequence()
        self._changed()  # the source's open pages become shared
        for pages in self.layers:
            pages.fork_row(int(source[0]), row)
        return row

    @outside_inference_mode
    def attach_prefix(self, layer: int, seq: int, pages: torch.Tensor) -> None:
        """Give the empty sequence ``seq`` the full pages ``pages`` (int64 ``[kv_heads, n]``, in
        use) of ``layer`` as its first ``n * page_size`` tokens, by reference (prefix reuse)."""
        layer = self._layer(layer)
        rows = self._rows([seq])
        self.layers[layer].attach_prefix(rows, pages, seq)
        self._changed(layer)
        self.read_caches.drop(layer, rows)

    @outside_inference_mode
    def set_logical_length(self, layer: int, seq: int, length: int) -> None:
        """Set the tokens ``seq`` has seen in ``layer`` (its logical length: where appends without
        positions continue) to ``length``, for a sequence restored holding fewer tokens than it
        has seen, at their own positions (a swapped-in sliding-window layer holds its window's).
        ``ValueError`` before any change when ``length`` is not past every stored position."""
        layer = self._layer(layer)
        rows = self._rows([seq])
        stored = self.layers[layer].stored_positions(rows)
        latest = int(stored.max()) if stored.numel() else -1
        if isinstance(length, bool) or not isinstance(length, int) or length <= latest:
            raise ValueError(f"length must be an int past every stored position of sequence {seq} in layer {layer}, got {length!r}")
        self.layers[layer].table.logical[rows] = length
        self._changed(layer)

    @outside_inference_mode
    def release(self, seqs: SequenceIds) -> None:
        """Drop sequences: their page references are released and their ids may be reused."""
        rows = self._rows(seqs)
        self._changed()
        for pages in self.layers:
            pages.release(rows)
        self.read_caches.forget(rows)  # the other rows stay cached
        self._ids.release(rows)
        if not self._ids:
            self._shrink()
        for layer in range(self.num_layers):
            self.trim(layer)

    def _shrink(self) -> None:
        """With no sequence live, give back what grew with the sequences (read caches, block
        table rows and page columns) down to a new store's sizes; row ids restart at 0. Pages
        (held by a prefix index, say) are untouched."""
        self.read_caches.clear()
        for pages in self.layers:
            pages.reset_table()
        self._ids.reset()

    # -- writes --------------------------------------------------------------------------------

    @outside_inference_mode
    def append(
        self, layer: int, seqs: SequenceIds, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> None:
        """Append a step's tokens to every head of ``seqs`` in ``layer``.

        Args:
            keys: ``[batch, kv_heads, new_tokens, head_dim]`` in the store's dtype and device.
            values: ``[batch, kv_heads, new_tokens, value_dim]``.
            positions: original absolute positions of the new tokens, int ``[batch, new_tokens]``
                or ``[new_tokens]``; by default they continue from each sequence's logical length.
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pages = self.layers[layer]
        _, heads, steps = pages.check_step(rows, keys, values)
        if self._layout is not None and not self._layout.unaffected_by_append(rows.numpy()):
            self._layout = None
        open_pages = pages.open_pages
        if positions is None and open_pages is not None and open_pages.fits(rows, steps):
            self._append_in_open_pages(layer, rows, open_pages, keys, values)
            return
        positions = pages.step_positions(rows, positions, heads=heads, steps=steps, device=self.device)
        if steps == 0:
            return
        pages.append(rows, keys, values, positions)
        pages.open_pages = OpenPages.after_append(pages.table, rows, self.device)
        self.peak_page_bytes = max(self.peak_page_bytes, self._page_bytes())
        self.read_caches.follow_append(layer, rows, tuple(rows.tolist()), keys, values, positions)

    def _append_in_open_pages(
        self, layer: int, rows: torch.Tensor, open_pages: OpenPages, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Fast path of :meth:`append`: every head's open page has room and is this batch's own,
        so the step is a write at known slots plus length updates (no allocation, no copy)."""
        positions = self.layers[layer].append_in_open_pages(rows, open_pages, keys, values)
        self.read_caches.follow_append(layer, rows, open_pages.rows, keys, values, positions)

    @outside_inference_mode
    def overwrite(self, layer: int, seqs: SequenceIds, token_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the keys and values of stored tokens ``token_index`` (int ``[tokens]``, the same
        slots in every head, each below every head's length) of ``seqs`` in ``layer``; positions
        stay. For a selective recompute. The pages written must be open (not sealed) and held by
        these sequences alone.

        Args:
            keys: ``[batch, kv_heads, tokens, head_dim]``; values: ``[..., value_dim]``.
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pages = self.layers[layer]
        pages.check_step(rows, keys, values)
        self._layout = None
        pages.overwrite(rows, token_index, keys, values)
        self.read_caches.drop(layer, rows)

    # -- planned decode steps (kvlib.storage.store.step_plan) ------------------------------------------------

    @outside_inference_mode
    def plan_step(self, seqs: SequenceIds, tokens: int, ring: Ring | None = None) -> StepPlan | None:
        """Plan a decode step of ``tokens`` new tokens for each of ``seqs`` in every layer (see
        :mod:`~kvlib.storage.store.step_plan`): where each goes, the block tables and lengths attention reads,
        what the step needs allocated in every layer at once, and every layer's block table
        counting the step's tokens already; ``ring``: a held cap kept as a ring of slots. None
        where no plan holds (a read cache, a pool that takes no planned writes, ...; nothing
        changed): the caller appends layer by layer. Otherwise every layer's new tokens must be
        written where the plan says (``plan.pools[layer].format.write_planned(plan, layer, keys, values)``,
        then ``attend_planned``) before anything else reads or changes the store."""
        rows = self._rows(seqs)
        layout = self._layout
        if layout is None or layout.ring is not ring or not layout.fits(rows, tokens):
            if self.read_caches.enabled or tokens < 1:
                return None
            layout = self._layout = build_layout(self.layers, rows, tokens, self.device, ring)
            for pages in self.layers:
                pages.open_pages = None  # the layout allocated pages: not self._changed(), which drops it
            self.peak_page_bytes = max(self.peak_page_bytes, self._page_bytes())
            if layout is None:
                return None
        plan = layout.take(tokens)
        for layer, pages in enumerate(self.layers):
            pages.table.advance(plan.rows_np, plan.stored if isinstance(plan.stored, int) else plan.stored[layer], tokens)
        return plan

    # -- compaction, truncation, sealing -------------------------------------------------------

    @outside_inference_mode
    def compact(
        self, layer: int, seqs: SequenceIds, keep: torch.Tensor, values: torch.Tensor | None = None, *, reuse_slots: bool = False
    ) -> torch.Tensor:
        """Keep only the given stored tokens of each (sequence, head) of ``layer``; free the rest.

        Args:
            keep: int ``[batch, kv_heads, k]`` indices into each head's stored tokens (physical
                slots, ``0 <= i < physical length``), in any order, no repeats; ``-1`` pads heads
                that keep fewer.
            values: optional new values of the kept tokens of heads that drop any,
                ``[batch, kv_heads, k, value_dim]`` aligned with ``keep`` sorted ascending (-1
                last), in the store's dtype (merging policies fold dropped values into kept ones).
            reuse_slots: let heads that drop few tokens fill the dropped slots (below); for callers
                that follow the returned layout and read positions, not slot order (the
                transformers cache, the Engine). Off, kept tokens stay in their order.

        Returns:
            The layout: int64 ``[batch, kv_heads, k]`` (CPU), the old slot of each new slot of every
            head, ``-1`` past its new length. Per-slot state kept beside the store (accumulated
            attention) follows it: ``state.gather(-1, layout.clamp(min=0))``.

        Each changed head takes the cheaper of two ways, and either keeps exactly the tokens named,
        each with its position:

        - *slot reuse* (:mod:`~kvlib.storage.layers.slot_reuse`): kept tokens at slots ``>= k`` move into the
          dropped slots below ``k``, nothing else moves, pages past the new length are released.
          Taken when it moves at most half the tokens the in-order rewrite would (a decode step's
          eviction moves at most one token) and every page it writes (the holes' pages, a partly
          kept last page) is writable in place: held by this head alone and not sealed. With
          ``reuse_slots`` and without ``values`` only. Slots are then no longer in position
          order (and a later :meth:`truncate` needs the tokens it drops to be a suffix of slots).
        - *in order*: kept tokens keep their order; full leading pages whose tokens all stay in
          place are kept as they are (with ``values``: only in heads that drop nothing), the rest
          of the head is written to fresh pages and its old pages are released, so pages shared
          with other sequences are never modified. Prefill and chunk-end compactions, which drop
          many tokens, take this way and leave slots in position order.
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        done = self.layers[layer].compact(rows, keep, values, reuse_slots=reuse_slots)
        if done.changed:
            self._changed(layer)
            self.read_caches.follow_compaction(layer, rows, done.reorder, done.moves, done.new_lengths)
            self.trim(layer)
        return done.layout

    @outside_inference_mode
    def arrange(self, layer: int, seqs: SequenceIds, order: torch.Tensor) -> torch.Tensor:
        """Put the stored tokens of each (sequence, head) of ``layer`` in the slot ``order`` given:
        int ``[batch, kv_heads, k]``, new slot ``i`` takes old slot ``order[..., i]``, every slot
        of the head named once (a permutation), ``-1`` padding last. Heads whose order changes are
        rewritten in order (:meth:`compact`'s second way) from their first moved page; each token
        keeps its position (slots then no longer follow positions). Returns the layout, as
        :meth:`compact` does. ``ValueError`` before any change if ``order`` drops or repeats a slot."""
        layer = self._layer(layer)
        rows = self._rows(seqs)
        if not torch.equal((torch.as_tensor(order) >= 0).sum(-1).cpu(), self.layers[layer].table.lengths[rows].cpu()):
            raise ValueError("order must name every stored slot of each head once (a permutation), -1 padding last")
        done = self.layers[layer].compact(rows, order, None, reuse_slots=False, in_given_order=True)
        if done.changed:
            self._changed(layer)
            self.read_caches.follow_compaction(layer, rows, done.reorder, done.moves, done.new_lengths)
        return done.layout

    def trim(self, layer: int) -> None:
        """Give back ``layer``'s idle arena memory when less than :data:`~kvlib.storage.layers.layer_pages.TRIM_BELOW` of it is in use
        (see :meth:`~kvlib.storage.layers.layer_pages.LayerPages.trim`): pages in use move down, the block tables follow.
        Nothing happens for pools that do not shrink (fixed, coded, tiered) or when something
        besides this store's block tables (a prefix index) holds pages of the layer."""
        layer = self._layer(layer)
        if self.layers[layer].trim():
            self._changed(layer)

    @outside_inference_mode
    def truncate(self, layer: int, seqs: SequenceIds, length: int | Sequence[int]) -> None:
        """Forget every stored token of ``layer`` whose position is ``>= length``; set the logical
        length of ``seqs`` to at most ``length`` (what rolling back rejected draft tokens needs).
        ``length``: one int for every sequence, or one per sequence of ``seqs`` (a batch rolled
        back to lengths of its own in one call).

        The tokens dropped must be a suffix of each head (positions ascending, as appends give
        them); otherwise nothing changes and ``ValueError`` is raised. No token moves: pages past
        the new end are released, a partly kept page stays as it is (shared or not; a pool that
        may not write it in place gives the head a private, open copy).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        each = [length] if isinstance(length, int) or not isinstance(length, Sequence) else list(length)
        if isinstance(length, Sequence) and len(each) != len(rows):
            raise ValueError(f"length must be an int or one int per sequence ({len(rows)}), got {len(each)} lengths")
        if any(not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63 for value in each):
            raise ValueError(f"length must be an int in [0, 2**63) or a sequence of them, got {length!r}")
        if isinstance(length, Sequence):
            length = torch.tensor(each, dtype=torch.int64)
        new_lengths = self.layers[layer].truncate(rows, length)
        self._changed(layer)
        self.read_caches.follow_truncation(layer, rows, new_lengths)

    @outside_inference_mode
    def seal(self, layer: int, seqs: SequenceIds, salience: Callable[[], torch.Tensor] | None = None) -> int:
        """Encode every full, open page of ``seqs`` in ``layer`` with the layer's codec; returns
        how many pages were sealed (0 without codecs, or while the codec is not yet fitted).
        ``salience`` (for a codec that reads it): called only when a page is to be sealed, float
        ``[len(seqs), kv_heads, slots]`` scores of the layer's stored slots, as :meth:`read` lays them out.

        Sealed pages then hold only the codec's fields; later reads decode them. A layer whose
        codec leans on a partner layer seals its pages in pairs with that layer's (see
        :meth:`~kvlib.storage.layers.layer_pages.LayerPages.seal`).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pages = self.layers[layer]
        partner = pages.pool.partner_layer
        sealed = pages.seal(rows, salience, None if partner is None else self.layers[partner])
        if sealed:
            self._layout = None  # sealing may move a coded pool's raw rows
            self.read_caches.drop(layer, rows)
            if partner is not None:
                self.read_caches.drop(partner, rows)
        return sealed
