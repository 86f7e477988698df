"""The paged KV store: per-layer page pools, block tables, positions, fork and compaction.

A *sequence* is an integer id (a row of every layer's :class:`~kvlib.storage.block_table.BlockTable`).
Each layer has its own :class:`~kvlib.storage.PagePool`; a head's tokens sit in its own pages, so
heads may keep different numbers of tokens and the pages they drop are really freed.

This module holds the store's state and its public API; each job is done in its own module,
by functions of a layer's pool and block table: :mod:`~kvlib.storage.layer_writes` (appends,
copy-on-write, overwrites), :mod:`~kvlib.storage.layer_reads` (dense, positional and sparse reads, key
bounds, page scores), :mod:`~kvlib.storage.layer_compaction` (compaction, hole fill, trimming),
:mod:`~kvlib.storage.layer_truncation` (truncation, reopening), :mod:`~kvlib.storage.layer_sealing`; the read
mirrors are a :class:`~kvlib.storage.read_caches.ReadMirrors`, the sequence ids a
:class:`~kvlib.storage.store_sequences.SequenceRows`, the pools come from
:func:`~kvlib.storage.pool_factory.build_pools` and a :class:`~kvlib.storage.store_config.StoreConfig`.

Invariants (after every public call; ``tests/storage/test_store_state_machine.py`` checks them):

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
- once no sequence is live, the read mirrors and block tables are back to a new store's sizes
  (what grew with a batch does not stay at its high-water mark);
- a growable arena that a compaction or a release leaves less than half in use shrinks to
  :func:`~kvlib.storage.page_pool.grown` of its pages in use (pages move down, the block tables follow), unless something
  besides this store's tables (a prefix index) holds pages of it.

All operations are vectorized over batch and heads: no Python loop runs per token or per head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlib.devices import outside_inference_mode
from kvlib.kernels.paged_attention import PagedLayer
from kvlib.storage import layer_compaction, layer_reads, layer_sealing, layer_truncation, layer_writes
from kvlib.storage.block_table import BlockTable
from kvlib.storage.open_pages import OpenPages
from kvlib.storage.page_prefetch import PagePrefetcher
from kvlib.storage.pool_factory import build_pools
from kvlib.storage.read_cache import LayerRead
from kvlib.storage.read_caches import ReadMirrors
from kvlib.storage.spill_store import SpillStore
from kvlib.storage.step_plan import DecodeLayout, Ring, StepPlan, build_layout
from kvlib.storage.store_config import StoreConfig
from kvlib.storage.store_sequences import SequenceIds, SequenceRows


class PagedStore:
    """Paged KV store for the attention layers of one model.

    Args:
        config: what the store holds and where (shapes, page size, capacity, codecs, tiers);
            see :class:`~kvlib.storage.store_config.StoreConfig`. What the arenas take up front must fit
            in the memory its device has available, else ``ValueError`` before anything is
            allocated.
        spill: a :class:`~kvlib.storage.spill_store.SpillStore` taking, with ``host_pages``, the
            host pages written longest ago once the host is full, at most ``disk_pages`` pages of
            each layer (the store owns its pages' records: freeing a page deletes its record).
        prefetcher: with ``device_pages``, each read of a layer starts fetching the host and disk
            pages of the same sequences in the layer read next (the first after the last, for
            the next decode step) on this :class:`~kvlib.storage.page_prefetch.PagePrefetcher`'s
            background thread (a copy stream on CUDA); the next read of that layer takes them.
            Reads return the same with or without it. None: no prefetch.
    """

    @outside_inference_mode
    def __init__(self, config: StoreConfig, *, spill: SpillStore | None = None, prefetcher: PagePrefetcher | None = None) -> None:
        self.config = config
        self.num_layers = config.num_layers
        self.page_size = config.page_size
        self.dtype = config.dtype
        self.device: torch.device = config.device
        if prefetcher is not None and config.device_pages is None:
            raise ValueError("prefetch fetches pages off the device ahead of their read: give device_pages (tiering) too")
        self.pools = build_pools(config, spill=spill)
        self.tables = [BlockTable(heads, self.page_size) for heads in config.layer_heads]
        self.prefetcher = prefetcher
        self.mirrors = ReadMirrors(self.num_layers, self.page_size, config.read_cache)
        """Per layer, the dense mirror of the last batch read (if ``config.read_cache``)."""
        self._open_pages: list[OpenPages | None] = [None] * self.num_layers
        """Per layer, where the last append's batch writes next (None: take the general path)."""
        self._layout: DecodeLayout | None = None
        """Where the planned decode steps of the last planned batch go (:meth:`plan_step`);
        dropped by every change to the store other than a planned write."""
        self._ids = SequenceRows()
        self.peak_page_bytes = 0
        """High-water mark of ``memory_bytes()["pages"]`` (updated whenever an append allocates pages)."""
        self.peak_workspace = 0
        """The most bytes one dense read not kept as a mirror has taken (a transient workspace a
        multi-token call attends over, freed when the call returns)."""

    @property
    def use_read_cache(self) -> bool:
        """Whether reads build dense mirrors (``config.read_cache``)."""
        return self.mirrors.enabled

    # -- sequences -----------------------------------------------------------------------------

    @property
    def sequences(self) -> list[int]:
        """Live sequence ids, ascending."""
        return self._ids.live

    @outside_inference_mode
    def new_sequence(self) -> int:
        """Create an empty sequence and return its id."""
        row = self._ids.take()
        for table in self.tables:
            table.ensure_rows(self._ids.row_count)
        return row

    @outside_inference_mode
    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` by reference (copy-on-write on change)."""
        source = self._rows([seq])
        row = self.new_sequence()
        self._changed()  # the source's open pages become shared
        for pool, table in zip(self.pools, self.tables):
            table.copy_row(int(source[0]), row)
            pool.incref(table.referenced_pages(torch.tensor([row])))
        return row

    @outside_inference_mode
    def attach_prefix(self, layer: int, seq: int, pages: torch.Tensor) -> None:
        """Give the empty sequence ``seq`` the full pages ``pages`` (int64 ``[kv_heads, n]``, in
        use) of ``layer`` as its first ``n * page_size`` tokens, by reference (prefix reuse)."""
        layer = self._layer(layer)
        rows = self._rows([seq])
        pool, table = self.pools[layer], self.tables[layer]
        if int(table.lengths[rows].sum()) or int(table.logical[rows].sum()):
            raise ValueError(f"attach_prefix needs an empty sequence; {seq} holds tokens in layer {layer}")
        if pages.dim() != 2 or pages.shape[0] != table.num_heads:
            raise ValueError(f"pages must be [kv_heads={table.num_heads}, n], got {list(pages.shape)}")
        count = pages.shape[1]
        pool.incref(pages.flatten())
        table.ensure_pages(count)
        table.pages[rows, :, :count] = pages
        table.lengths[rows] = count * self.page_size
        table.logical[rows] = count * self.page_size
        self._changed(layer)
        self.mirrors.drop(layer, rows)

    @outside_inference_mode
    def release(self, seqs: SequenceIds) -> None:
        """Drop sequences: their page references are released and their ids may be reused."""
        rows = self._rows(seqs)
        self._changed()
        for pool, table in zip(self.pools, self.tables):
            pool.decref(table.referenced_pages(rows))
            table.clear(rows)
        self.mirrors.forget(rows)  # the other rows stay mirrored
        self._ids.release(rows)
        if not self._ids:
            self._shrink()
        for layer in range(self.num_layers):
            self.trim(layer)

    def _shrink(self) -> None:
        """With no sequence live, give back what grew with the sequences (read mirrors, block
        table rows and page columns) down to a new store's sizes; row ids restart at 0. Pages
        (held by a prefix index, say) are untouched."""
        self.mirrors.clear()
        self.tables = [BlockTable(table.num_heads, self.page_size) for table in self.tables]
        self._ids.reset()

    def mirrored_rows(self, layer: int) -> tuple[int, ...]:
        """The sequences ``layer``'s read mirror holds, in its row order (empty without one): a
        batch that starts with them in this order reads without regathering."""
        return self.mirrors.rows(self._layer(layer))

    def logical_lengths(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Tokens each sequence has seen in ``layer``: int64 ``[batch]`` (a copy)."""
        return self.tables[self._layer(layer)].logical[self._rows(seqs)]

    def physical_lengths(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Tokens stored per head in ``layer``: int64 ``[batch, kv_heads]`` (a copy)."""
        return self.tables[self._layer(layer)].lengths[self._rows(seqs)]

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
        pool, table = self.pools[layer], self.tables[layer]
        _, heads, steps = layer_writes.check_step(layer, pool, table, rows, keys, values)
        if self._layout is not None and not self._layout.unaffected_by_append(rows.numpy()):
            self._layout = None
        open_pages = self._open_pages[layer]
        if positions is None and open_pages is not None and open_pages.fits(rows, steps):
            self._append_in_open_pages(layer, rows, open_pages, keys, values)
            return
        positions = layer_writes.step_positions(table, rows, positions, heads=heads, steps=steps, device=self.device)
        if steps == 0:
            return
        layer_writes.append(layer, pool, table, rows, keys, values, positions)
        self._open_pages[layer] = OpenPages.after_append(table, rows, self.device)
        self.peak_page_bytes = max(self.peak_page_bytes, self._page_bytes())
        self.mirrors.follow_append(layer, rows, tuple(rows.tolist()), keys, values, positions)

    def _append_in_open_pages(
        self, layer: int, rows: torch.Tensor, open_pages: OpenPages, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Fast path of :meth:`append`: every head's open page has room and is this batch's own,
        so the step is a write at known slots plus length updates (no allocation, no copy)."""
        positions = layer_writes.append_in_open_pages(self.pools[layer], self.tables[layer], rows, open_pages, keys, values)
        self.mirrors.follow_append(layer, rows, open_pages.rows, keys, values, positions)

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
        pool, table = self.pools[layer], self.tables[layer]
        layer_writes.check_step(layer, pool, table, rows, keys, values)
        self._layout = None
        layer_writes.overwrite(pool, table, rows, token_index, keys, values)
        self.mirrors.drop(layer, rows)

    # -- planned decode steps (kvlib.storage.step_plan) ------------------------------------------------

    @outside_inference_mode
    def plan_step(self, seqs: SequenceIds, tokens: int, ring: Ring | None = None) -> StepPlan | None:
        """Plan a decode step of ``tokens`` new tokens for each of ``seqs`` in every layer (see
        :mod:`~kvlib.storage.step_plan`): where each goes, the block tables and lengths attention reads,
        what the step needs allocated in every layer at once, and every layer's block table
        counting the step's tokens already; ``ring``: a held cap kept as a ring of slots. None
        where no plan holds (a read mirror, a pool that takes no planned writes, ...; nothing
        changed): the caller appends layer by layer. Otherwise every layer's new tokens must be
        written where the plan says (``plan.pools[layer].write_planned(plan, layer, keys, values)``,
        then ``attend_planned``) before anything else reads or changes the store."""
        rows = self._rows(seqs)
        layout = self._layout
        if layout is None or layout.ring is not ring or not layout.fits(rows, tokens):
            if self.mirrors.enabled or tokens < 1:
                return None
            layout = self._layout = build_layout(self.pools, self.tables, rows, tokens, self.device, ring)
            self._open_pages = [None] * self.num_layers
            self.peak_page_bytes = max(self.peak_page_bytes, self._page_bytes())
            if layout is None:
                return None
        plan = layout.take(tokens)
        for layer, table in enumerate(self.tables):
            table.advance(plan.rows_np, plan.stored if isinstance(plan.stored, int) else plan.stored[layer], tokens)
        return plan

    # -- reads ---------------------------------------------------------------------------------

    @outside_inference_mode
    def read(self, layer: int, seqs: SequenceIds, *, mirror: bool = True) -> LayerRead:
        """``seqs``' stored tokens of ``layer`` in dense form (see :class:`~kvlib.storage.read_cache.LayerRead`).

        With the read cache on, the result is a view of a dense mirror that later appends extend
        in place: use it before the next change to the store. ``mirror=False`` gathers without
        building a mirror (and keeps the layer's current one, for another batch).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        lengths = self.tables[layer].lengths[rows]
        mirrored = self.mirrors.read(layer, rows, lengths, lambda part, size: self._gather(layer, part, size), mirror=mirror)
        if mirrored is not None:
            return mirrored
        workspace = self._gather(layer, rows, int(lengths.max()) if lengths.numel() else 0)
        self.peak_workspace = max(self.peak_workspace, sum(t.nbytes for t in workspace))
        return workspace

    def read_positions(self, layer: int, seqs: SequenceIds) -> LayerRead:
        """``seqs``' stored tokens of ``layer`` as :meth:`read` lays them out, without their keys
        and values: ``keys`` and ``values`` have no channels (``[batch, kv_heads, slots, 0]``);
        ``positions`` and ``valid`` are :meth:`read`'s. What an eviction strategy that scores by
        positions and attention needs after a call that attended over the pages (8 bytes a token)."""
        layer = self._layer(layer)
        return layer_reads.read_positions(self.pools[layer], self.tables[layer], self._rows(seqs))

    @outside_inference_mode
    def paged_layer(self, layer: int, seqs: SequenceIds) -> PagedLayer | None:
        """``seqs``' tokens of ``layer`` where they lie, for attention straight over the pages
        (:mod:`~kvlib.kernels.paged_attention`; coded pages are decoded inside the kernel; a tiered pool stages only its off-device pages, see
        :meth:`~kvlib.storage.tiered_pool.TieredPagePool.paged_layer`, and the next layer's are
        prefetched as for :meth:`read`); None when the layer's pool cannot give its pages in place
        (codecs without a page loader: use :meth:`read`). Valid until the next change to the store or the next hand-over
        of the layer's pages (:meth:`paged_layer`, :meth:`paged_selection`: a tiered pool restages)."""
        layer = self._layer(layer)
        table = self.tables[layer]
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
        pages, lengths = layer_reads.selected_pages(self.tables[layer], self._rows(seqs), page_index)
        return self._pool_pages(layer, pages, lengths)

    def _pool_pages(self, layer: int, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """The pool's :meth:`~kvlib.storage.page_pool.PagePool.paged_layer`; what a tiered pool
        staged for it counts as a transient workspace (``peak_workspace``)."""
        pool = self.pools[layer]
        paged = pool.paged_layer(pages, lengths)
        self.peak_workspace = max(self.peak_workspace, pool.staged_bytes)
        return paged

    def _gather(self, layer: int, rows: torch.Tensor, size: int) -> LayerRead:
        """:func:`~kvlib.storage.layer_reads.gather` of ``rows`` with ``size`` slots a head, then the
        following layer's prefetch."""
        read = layer_reads.gather(self.pools[layer], self.tables[layer], rows, size)
        if self.pools[layer].pages_in_use:  # pages were read (none from an empty pool)
            self._prefetch_following(layer, rows)
        return read

    def _prefetch_following(self, layer: int, rows: torch.Tensor) -> None:
        """With a prefetcher, start fetching the off-device pages of ``rows`` in the layer read
        after ``layer`` (the first after the last)."""
        if self.prefetcher is not None:
            following = (layer + 1) % self.num_layers
            pages = self.tables[following].pages[rows]
            self.pools[following].prefetch(pages[pages >= 0], self.prefetcher)

    def key_bounds(self, layer: int, seqs: SequenceIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key summaries of every page of ``seqs`` in ``layer``, in block-table order:
        ``(key_min, key_max)``, each ``[batch, kv_heads, pages, head_dim]`` on the store's device
        (entries past a head's ``pages_used`` are meaningless), and ``pages_used`` int64
        ``[batch, kv_heads]`` on the CPU. Needs a store made with ``key_summaries=True``."""
        layer = self._layer(layer)
        return layer_reads.key_bounds(self.pools[layer], self.tables[layer], self._rows(seqs))

    @outside_inference_mode
    def read_selected(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor) -> LayerRead:
        """Only the chosen pages of each (sequence, head) of ``layer``, in dense form: a sparse read.

        ``page_index`` int64 ``[batch, kv_heads, k]`` (CPU) names pages by their index in each
        head's block table (``0 <= j < pages used``), ``-1`` for none. Returns a
        :class:`~kvlib.storage.read_cache.LayerRead` of up to ``k * page_size`` slots per head: page ``i``
        of the selection fills slots ``[i * page_size, (i + 1) * page_size)``, slots past the
        head's length or of a ``-1`` entry are zero and invalid, and trailing slots invalid in
        every head are left out (a selection of every page reads what :meth:`read` does). Only the chosen pages are read (with a
        tiered pool, only chosen host pages are copied to the device); nothing moves or changes.
        """
        layer = self._layer(layer)
        return layer_reads.read_selected(self.pools[layer], self.tables[layer], self._rows(seqs), page_index)

    @outside_inference_mode
    def stored_positions(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Positions of the stored tokens of ``seqs``: int64 ``[batch, heads, longest]`` on the CPU,
        -1 past each head's length (read from the arena without touching keys or values)."""
        layer = self._layer(layer)
        return layer_reads.stored_positions(self.pools[layer], self.tables[layer], self._rows(seqs))

    @outside_inference_mode
    def rank_pages(self, layer: int, seqs: SequenceIds, token_scores: torch.Tensor) -> None:
        """Rank the pages of ``seqs`` in ``layer`` for the device tier by ``token_scores`` (float
        ``[batch, kv_heads, slots]``, aligned with :meth:`read`'s slots; ``-inf`` for tokens that
        should not count): a page scores its best stored token, a page shared by several heads the
        best over them. The best-scored pages in use then sit on the device (see
        :meth:`~kvlib.storage.tiered_pool.TieredPagePool.rank`). Needs a tiered store."""
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pool = self.pools[layer]
        if pool.device_pages is None:
            raise ValueError("rank_pages needs a tiered store (device_pages=...)")
        pool.rank(*layer_reads.page_scores(self.tables[layer], rows, token_scores))

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
                last), in the store's dtype (merging strategies fold dropped values into kept ones).
            reuse_slots: let heads that drop few tokens fill the dropped slots (below); for callers
                that follow the returned layout and read positions, not slot order (the
                transformers cache, the Engine). Off, kept tokens stay in their order.

        Returns:
            The layout: int64 ``[batch, kv_heads, k]`` (CPU), the old slot of each new slot of every
            head, ``-1`` past its new length. Per-slot state kept beside the store (accumulated
            attention) follows it: ``state.gather(-1, layout.clamp(min=0))``.

        Each changed head takes the cheaper of two ways, and either keeps exactly the tokens named,
        each with its position:

        - *slot reuse* (:mod:`~kvlib.storage.slot_reuse`): kept tokens at slots ``>= k`` move into the
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
        done = layer_compaction.compact(layer, self.pools[layer], self.tables[layer], rows, keep, values, reuse_slots=reuse_slots)
        if done.changed:
            self._changed(layer)
            self.mirrors.follow_compaction(layer, rows, done.reorder, done.moves, done.new_lengths)
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
        if not torch.equal((torch.as_tensor(order) >= 0).sum(-1).cpu(), self.tables[layer].lengths[rows].cpu()):
            raise ValueError("order must name every stored slot of each head once (a permutation), -1 padding last")
        done = layer_compaction.compact(
            layer, self.pools[layer], self.tables[layer], rows, order, None, reuse_slots=False, in_given_order=True
        )
        if done.changed:
            self._changed(layer)
            self.mirrors.follow_compaction(layer, rows, done.reorder, done.moves, done.new_lengths)
        return done.layout

    def trim(self, layer: int) -> None:
        """Give back ``layer``'s idle arena memory when less than
        :data:`~kvlib.storage.layer_compaction.TRIM_BELOW` of it is in use (see
        :func:`~kvlib.storage.layer_compaction.trim`): pages in use move down, the block tables follow.
        Nothing happens for pools that do not shrink (fixed, coded, tiered) or when something
        besides this store's block tables (a prefix index) holds pages of the layer."""
        layer = self._layer(layer)
        if layer_compaction.trim(self.pools[layer], self.tables[layer]):
            self._changed(layer)

    @outside_inference_mode
    def truncate(self, layer: int, seqs: SequenceIds, length: int) -> None:
        """Forget every stored token of ``layer`` whose position is ``>= length``; set the logical
        length of ``seqs`` to at most ``length`` (what rolling back rejected draft tokens needs).

        The tokens dropped must be a suffix of each head (positions ascending, as appends give
        them); otherwise nothing changes and ``ValueError`` is raised. No token moves: pages past
        the new end are released, a partly kept page stays as it is (shared or not; a pool that
        may not write it in place gives the head a private, open copy).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length < 2**63:
            raise ValueError(f"length must be an int in [0, 2**63), got {length!r}")
        new_lengths = layer_truncation.truncate(layer, self.pools[layer], self.tables[layer], rows, length)
        self._changed(layer)
        self.mirrors.follow_truncation(layer, rows, new_lengths)

    @outside_inference_mode
    def seal(self, layer: int, seqs: SequenceIds, salience: Callable[[], torch.Tensor] | None = None) -> int:
        """Encode every full, open page of ``seqs`` in ``layer`` with the layer's codec; returns
        how many pages were sealed (0 without codecs, or while the codec is not yet fitted).
        ``salience`` (for a codec that reads it): called only when a page is to be sealed, float
        ``[len(seqs), kv_heads, slots]`` scores of the layer's stored slots, as :meth:`read` lays them out.

        Sealed pages then hold only the codec's fields; later reads decode them. A layer whose
        codec leans on a partner layer seals its pages in pairs with that layer's (see
        :func:`~kvlib.storage.layer_sealing.seal`).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        sealed = layer_sealing.seal(layer, self.pools, self.tables, rows, salience)
        if sealed:
            self._layout = None  # sealing may move a coded pool's raw rows
            self.mirrors.drop(layer, rows)
            partner = self.pools[layer].partner_layer
            if partner is not None:
                self.mirrors.drop(partner, rows)
        return sealed

    def bytes_in_use(self) -> int:
        """Bytes held by pages in use across all layers (keys, values, positions)."""
        return sum(pool.bytes_in_use() for pool in self.pools)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held, by component: ``pages`` (keys and values of pages in use: compute dtype for
        open pages, the codec's payload for sealed ones; on every tier), ``host`` and ``disk``
        (the parts of ``pages`` held in host memory and spilled to disk), ``positions``,
        ``codec_metadata`` (scales, zero points and fitted codec state), ``key_summaries`` (the key
        minima and maxima of pages in use, on the device: page retrieval), ``tables`` (block tables
        and lengths), ``read_cache`` (dense mirrors) and ``reserved`` (whole arenas, free pages included)."""
        parts = [part for table in self.tables for part in (table.pages, table.lengths, table.logical, table.sealed)]
        tiers = [pool.tier_bytes() for pool in self.pools]
        return {
            "pages": self._page_bytes(),
            "positions": sum(pool.pages_in_use * pool.position_page_bytes for pool in self.pools),
            "codec_metadata": sum(pool.metadata_bytes() for pool in self.pools),
            "key_summaries": sum(pool.pages_in_use * pool.summaries.page_bytes for pool in self.pools if pool.summaries is not None),
            "host": sum(tier["host"] for tier in tiers),
            "disk": sum(tier["disk"] for tier in tiers),
            "tables": sum(part.numel() * part.element_size() for part in parts),
            "read_cache": self.mirrors.nbytes(),
            "reserved": sum(pool.bytes_reserved() for pool in self.pools),
        }

    def _page_bytes(self) -> int:
        """Bytes of keys and values of the pages in use, over all layers (``memory_bytes()["pages"]``)."""
        return sum(pool.data_bytes() for pool in self.pools)

    def _changed(self, layer: int | None = None) -> None:
        """``layer``'s block tables or pages (every layer's, for None) changed other than by a
        planned write: where appends go next is worked out again."""
        if layer is None:
            self._open_pages = [None] * self.num_layers
        else:
            self._open_pages[layer] = None
        self._layout = None

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def _rows(self, seqs: SequenceIds) -> torch.Tensor:
        return self._ids.rows(seqs)
