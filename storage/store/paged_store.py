"""The paged KV store: per-layer page pools, block tables, positions, fork and compaction.

A *sequence* is an integer id (a row of every layer's :class:`~kvlib.storage.layers.block_table.BlockTable`).
Each layer has its own :class:`~kvlib.storage.PagePool`; a head's tokens sit in its own pages, so
heads may keep different numbers of tokens and the pages they drop are really freed.

This module holds the store's public API that changes it (sequences, writes, planned steps,
compaction, truncation, sealing); its reads are :class:`~kvlib.storage.store.store_reads.StoreReads`,
its state, lengths and bytes :class:`~kvlib.storage.store.store_state.StoreState`. Each layer is a
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

from collections.abc import Callable

import torch

from kvlib.devices import outside_inference_mode
from kvlib.storage.layers.open_pages import OpenPages
from kvlib.storage.store.step_plan import Ring, StepPlan, build_layout
from kvlib.storage.store.store_reads import StoreReads
from kvlib.storage.store.store_sequences import SequenceIds


class PagedStore(StoreReads):
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
            background thread (a copy stream on CUDA); the next read of that layer takes them.
            Reads return the same with or without it. None: no prefetch.
    """

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
        written where the plan says (``plan.pools[layer].write_planned(plan, layer, keys, values)``,
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
        """Give back ``layer``'s idle arena memory when less than :data:`~kvlib.storage.layers.layer_compaction.TRIM_BELOW` of it is in use
        (see :meth:`~kvlib.storage.layers.layer_compaction.LayerCompaction.trim`): pages in use move down, the block tables follow.
        Nothing happens for pools that do not shrink (fixed, coded, tiered) or when something
        besides this store's block tables (a prefix index) holds pages of the layer."""
        layer = self._layer(layer)
        if self.layers[layer].trim():
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
        :meth:`~kvlib.storage.layers.layer_sealing.LayerSealing.seal`).
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
