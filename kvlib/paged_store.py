"""The paged KV store: per-layer page pools, block tables, positions, fork and compaction.

A *sequence* is an integer id (a row of every layer's :class:`~kvlib.block_table.BlockTable`).
Each layer has its own :class:`~kvlib.storage.PagePool`; a head's tokens sit in its own pages, so
heads may keep different numbers of tokens and the pages they drop are really freed.

Invariants (after every public call; ``tests/kvlib/test_store_state_machine.py`` checks them):

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

from collections.abc import Sequence

import torch

from kvlib.block_table import BlockTable
from kvlib.codec import PageCodec
from kvlib.devices import check_fits, check_tensor, outside_inference_mode, resolve_device, to_arena_device
from kvlib.errors import PoolExhaustedError, quoted
from kvlib.limits import check_page_size
from kvlib.open_pages import OpenPages
from kvlib.page_indexing import first_occurrences, heads_to_copy, page_coordinates, sorted_keep
from kvlib.paged_attention import PagedLayer
from kvlib.placement import Placement
from kvlib.read_cache import DenseReadCache, LayerRead
from kvlib.slot_reuse import HoleFill, hole_fill
from kvlib.storage.coded_pool import CodedPagePool
from kvlib.storage.page_pool import PagePool, grown
from kvlib.storage.partnered_pool import PartneredPagePool
from kvlib.storage.spill_store import SpillStore
from kvlib.storage.page_prefetch import PagePrefetcher
from kvlib.storage.tiered_pool import TieredPagePool

SequenceIds = Sequence[int] | torch.Tensor

DEFAULT_PAGES_PER_LAYER = 64
"""Pages each layer's arena holds when a store is built (a growable arena grows from there)."""

TRIM_BELOW = 0.5
"""A growable arena with less than this share of its pages in use after a compaction or a
release gives the idle part back (:meth:`PagedStore.trim`)."""

FIRST_ROWS = 16
"""Key and value rows a coded pool's raw arena and a tiered pool's host arena start with, and
the fewest a tiered pool's device arena may (see :func:`initial_arena_bytes`)."""


class PagedStore:
    """Paged KV store for the attention layers of one model.

    Args:
        num_layers: attention layers stored.
        num_kv_heads: KV heads per layer (an int, or one per layer).
        head_dim: key channels per head (an int, or one per layer).
        value_dim: value channels per head; defaults to ``head_dim``.
        page_size: tokens per page (at most :data:`~kvlib.limits.MAX_PAGE_SIZE`).
        dtype: compute dtype of keys and values.
        device: where the page arenas live.
        pages_per_layer: initial arena capacity in pages (the capacity, if ``fixed_capacity``).
            What the arenas take up front (:func:`initial_arena_bytes`) must fit in the memory
            ``device`` has available, else ``ValueError`` before anything is allocated.
        fixed_capacity: never grow the arenas; appends that do not fit raise
            :class:`~kvlib.errors.PoolExhaustedError` and change nothing.
        read_cache: keep a dense per-layer mirror of the last batch read so decode steps copy
            only new tokens (see :mod:`kvlib.read_cache`); its bytes are reported separately.
        codecs: one :class:`~kvlib.codec.PageCodec` per layer to encode sealed pages with
            (see :meth:`seal`; None for a layer kept in ``dtype``), or None to keep every page
            in ``dtype``. A codec with a ``partner_layer`` (a cross-layer codec's deeper layer)
            gets a :class:`~kvlib.storage.partnered_pool.PartneredPagePool` leaning on that
            earlier layer's pool.
        device_pages: at most this many pages of each layer stay on ``device``; the least
            recently used others move to host memory (:class:`~kvlib.storage.tiered_pool.TieredPagePool`).
            None keeps every page on the device. Not combined with codecs. ``host_pages`` bounds
            the host part (None: unbounded).
        key_summaries: keep each page's channel-wise key min and max on ``device`` (for
            ``quest``; see :meth:`key_bounds` and :meth:`read_selected`). Not combined with codecs.
        spill: a :class:`~kvlib.storage.spill_store.SpillStore` taking, with ``host_pages``, the
            host pages written longest ago once the host is full, at most ``disk_pages`` pages of
            each layer (the store owns its pages' records: freeing a page deletes its record).
        prefetch: with ``device_pages``, each read of a layer starts fetching the host and disk
            pages of the same sequences in the layer read next (the first after the last, for
            the next decode step) on a background thread (:mod:`~kvlib.storage.page_prefetch`;
            a copy stream on CUDA); the next read of that layer takes them. Reads return the
            same with or without it. True for a default
            :class:`~kvlib.storage.page_prefetch.PagePrefetcher`, or one to use.
        placement: with ``device_pages``, the rule ordering the pages that leave the device and
            the host (a tiering strategy; see :mod:`kvlib.placement`). None: lowest placement
            score first, then least recently written.
    """

    @outside_inference_mode
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int | Sequence[int],
        head_dim: int | Sequence[int],
        *,
        value_dim: int | Sequence[int] | None = None,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        pages_per_layer: int = DEFAULT_PAGES_PER_LAYER,
        fixed_capacity: bool = False,
        read_cache: bool = True,
        codecs: Sequence[PageCodec] | None = None,
        device_pages: int | None = None,
        host_pages: int | None = None,
        key_summaries: bool = False,
        spill: SpillStore | None = None,
        disk_pages: int = 0,
        prefetch: bool | PagePrefetcher = False,
        placement: Placement | None = None,
    ) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        check_page_size(page_size)
        heads = _per_layer("num_kv_heads", num_kv_heads, num_layers)
        keys_dim = _per_layer("head_dim", head_dim, num_layers)
        values_dim = keys_dim if value_dim is None else _per_layer("value_dim", value_dim, num_layers)
        if isinstance(pages_per_layer, bool) or not isinstance(pages_per_layer, int) or pages_per_layer < int(fixed_capacity):
            raise ValueError(f"pages_per_layer must be an int >= {int(fixed_capacity)}, got {quoted(pages_per_layer)}")
        check_fits(
            f"a store of {num_layers} layers with pages_per_layer={pages_per_layer} of page_size={page_size} tokens",
            initial_arena_bytes(
                keys_dim, values_dim, page_size, dtype, pages_per_layer, coded=codecs is not None, tiered=device_pages is not None
            ),
            resolve_device(device),
        )
        self.num_layers = num_layers
        self.page_size = page_size
        self.dtype = dtype
        self.device = resolve_device(device)
        self.use_read_cache = read_cache
        if device_pages is not None and codecs is not None:
            raise ValueError("device_pages (tiering) and codecs do not combine yet: keep one of them")
        if key_summaries and codecs is not None:
            raise ValueError("key_summaries (quest) and codecs do not combine yet: keep one of them")
        if spill is not None and (device_pages is None or host_pages is None):
            raise ValueError("a spill (disk tier) goes behind the host tier: give device_pages and host_pages too")
        if prefetch and device_pages is None:
            raise ValueError("prefetch fetches pages off the device ahead of their read: give device_pages (tiering) too")
        if codecs is not None and len(codecs) != num_layers:
            raise ValueError(f"codecs must name one codec per layer ({num_layers}), got {len(codecs)}")
        self.pools: list[PagePool] = []
        self.partners: dict[int, int] = {}
        """Deeper layer -> the earlier layer its pages lean on (cross-layer codecs)."""
        for i in range(num_layers):
            codec = None if codecs is None else codecs[i]
            shape = (page_size, keys_dim[i], values_dim[i], dtype, self.device)
            if codec is None and device_pages is not None:
                layer_spill = None if spill is None else spill.layer(i, page_size, keys_dim[i], values_dim[i], dtype)
                pool: PagePool = TieredPagePool(
                    *shape, device_pages, pages_per_layer, fixed_capacity, host_pages, key_summaries, layer_spill, disk_pages,
                    placement=placement,
                )
            elif codec is None:
                pool = PagePool(*shape, pages_per_layer, fixed_capacity, key_summaries)
            elif getattr(codec, "partner_layer", None) is not None:
                partner = codec.partner_layer
                if not 0 <= partner < i or not isinstance(self.pools[partner], CodedPagePool):
                    raise ValueError(f"layer {i}'s codec leans on layer {partner}, which must be an earlier coded layer")
                pool = PartneredPagePool(*shape, codec, self.pools[partner], pages_per_layer, fixed_capacity)
                self.partners[i] = partner
            else:
                pool = CodedPagePool(*shape, codec, pages_per_layer, fixed_capacity)
            self.pools.append(pool)
        self.tables = [BlockTable(heads[i], page_size) for i in range(num_layers)]
        self.prefetcher = prefetch if isinstance(prefetch, PagePrefetcher) else PagePrefetcher(self.device) if prefetch else None
        self._read_caches: list[DenseReadCache | None] = [None] * num_layers
        self._open_pages: list[OpenPages | None] = [None] * num_layers
        self._last_rows: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.peak_pages = 0
        self.peak_workspace = 0
        """The most bytes one dense read not kept as a mirror has taken (a transient workspace a
        multi-token call attends over, freed when the call returns)."""
        """High-water mark of ``memory_bytes()["pages"]`` (updated whenever an append allocates pages)."""
        """The last batch of ids validated and its row tensor (read-only; reset when ids are released)."""
        self._live: set[int] = set()
        self._free_rows: list[int] = []
        self._next_row = 0

    # -- sequences -----------------------------------------------------------------------------

    @property
    def sequences(self) -> list[int]:
        """Live sequence ids, ascending."""
        return sorted(self._live)

    @outside_inference_mode
    def new_sequence(self) -> int:
        """Create an empty sequence and return its id."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._next_row
            self._next_row += 1
            for table in self.tables:
                table.ensure_rows(self._next_row)
        self._live.add(row)
        return row

    @outside_inference_mode
    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` by reference (copy-on-write on change)."""
        source = self._rows([seq])
        row = self.new_sequence()
        self._open_pages = [None] * self.num_layers  # the source's open pages become shared
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
        self._open_pages[layer] = None
        self._drop_read_cache(layer, rows)

    @outside_inference_mode
    def release(self, seqs: SequenceIds) -> None:
        """Drop sequences: their page references are released and their ids may be reused."""
        rows = self._rows(seqs)
        self._open_pages = [None] * self.num_layers
        for layer, (pool, table) in enumerate(zip(self.pools, self.tables)):
            pool.decref(table.referenced_pages(rows))
            table.clear(rows)
            cache = self._read_caches[layer]
            if cache is not None and not set(cache.rows).isdisjoint(rows.tolist()):  # the others stay mirrored
                cache.drop_rows(set(rows.tolist()))
        for row in rows.tolist():
            self._live.discard(row)
            self._free_rows.append(row)
        self._last_rows = None
        if not self._live:
            self._shrink()
        for layer in range(self.num_layers):
            self.trim(layer)

    def _shrink(self) -> None:
        """With no sequence live, give back what grew with the sequences (read mirrors, block
        table rows and page columns) down to a new store's sizes; row ids restart at 0. Pages
        (held by a prefix index, say) are untouched."""
        self._read_caches = [None] * self.num_layers
        self.tables = [BlockTable(table.num_heads, self.page_size) for table in self.tables]
        self._free_rows = []
        self._next_row = 0

    def mirrored_rows(self, layer: int) -> tuple[int, ...]:
        """The sequences ``layer``'s read mirror holds, in its row order (empty without one): a
        batch that starts with them in this order reads without regathering."""
        cache = self._read_caches[self._layer(layer)]
        return () if cache is None else cache.rows

    def logical_lengths(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Tokens each sequence has seen in ``layer``: int64 ``[batch]`` (a copy)."""
        return self.tables[self._layer(layer)].logical[self._rows(seqs)]

    def physical_lengths(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Tokens stored per head in ``layer``: int64 ``[batch, kv_heads]`` (a copy)."""
        return self.tables[self._layer(layer)].lengths[self._rows(seqs)]

    # -- append --------------------------------------------------------------------------------

    @outside_inference_mode
    def append(
        self,
        layer: int,
        seqs: SequenceIds,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor | None = None,
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
        batch, heads, steps = self._check_step(layer, rows, keys, values)
        open_pages = self._open_pages[layer]
        if positions is None and open_pages is not None and open_pages.fits(rows, steps):
            self._append_in_open_pages(layer, rows, open_pages, keys, values)
            return
        positions = self._step_positions(table, rows, positions, batch, heads, steps)
        if steps == 0:
            return
        lengths = table.lengths[rows]
        new_lengths = lengths + steps
        have, need = table.pages_used(lengths), table.pages_used(new_lengths)

        # Copy-on-write: a partly filled last page shared with another sequence is copied first.
        open_index = lengths // self.page_size
        is_open = lengths % self.page_size != 0
        open_pages = table.pages[rows].gather(2, torch.where(is_open, open_index, 0).unsqueeze(-1)).squeeze(-1)
        shared = is_open.clone()
        shared[is_open] = pool.refcount[open_pages[is_open]] > 1
        b, h = heads_to_copy(pool, open_pages, shared)
        new_page_counts = (need - have).flatten()
        copies = b.numel()
        fresh = int(new_page_counts.sum())
        if not pool.can_allocate(copies + fresh):
            raise PoolExhaustedError(
                f"layer {layer}: append needs {copies + fresh} pages, {pool.free_pages} free"
            )
        table.ensure_pages(int(need.max()))
        if copies:
            copied = pool.allocate(copies, h)
            pool.copy_pages(open_pages[b, h], copied)
            pool.decref(open_pages[b, h])
            table.pages[rows[b], h, open_index[b, h]] = copied
        if fresh:
            b, h, j = page_coordinates(have, new_page_counts, heads)
            table.pages[rows[b], h, j] = pool.allocate(fresh, h)

        token_index = lengths.unsqueeze(-1) + torch.arange(steps)
        slots = table.flat_slots(rows, token_index)
        pool.write(
            slots.flatten(),
            keys.reshape(-1, pool.head_dim),
            values.reshape(-1, pool.value_dim),
            positions.reshape(-1),
        )
        table.lengths[rows] = new_lengths
        table.logical[rows] += steps
        self._open_pages[layer] = OpenPages.after_append(self, layer, rows)
        self.peak_pages = max(self.peak_pages, self._page_bytes())

        self._mirror_append(layer, rows, tuple(rows.tolist()), keys, values, positions)

    def _append_in_open_pages(
        self, layer: int, rows: torch.Tensor, open_pages: OpenPages, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Fast path of :meth:`append`: every head's open page has room and is this batch's own,
        so the step is a write at known slots plus length updates (no allocation, no copy)."""
        pool, table = self.pools[layer], self.tables[layer]
        batch, heads, steps = keys.shape[:3]
        slots, positions = open_pages.take(steps, cpu=isinstance(pool, CodedPagePool))
        pool.write(slots.reshape(-1), keys.reshape(-1, pool.head_dim), values.reshape(-1, pool.value_dim), positions.reshape(-1))
        if open_pages.row_range is not None:
            first, end = open_pages.row_range
            table.lengths[first:end] += steps
            table.logical[first:end] += steps
        else:
            table.lengths[rows] += steps
            table.logical[rows] += steps
        self._mirror_append(layer, rows, open_pages.rows, keys, values, positions)

    def _mirror_append(
        self, layer: int, rows: torch.Tensor, key: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Keep the layer's read mirror in step with an append to ``rows`` (``key``, as a tuple):
        extended when it mirrors these rows or a leading part of them (the others join it at the
        next read), dropped when it mirrors any of them otherwise."""
        cache = self._read_caches[layer]
        if cache is None:
            return
        mirrored = len(cache.rows)
        if cache.rows == key[:mirrored]:
            cache.append(keys[:mirrored], values[:mirrored], positions[:mirrored])
        else:
            self._drop_read_cache(layer, rows)

    # -- read ----------------------------------------------------------------------------------

    @outside_inference_mode
    def read(self, layer: int, seqs: SequenceIds, *, mirror: bool = True) -> LayerRead:
        """``seqs``' stored tokens of ``layer`` in dense form (see :class:`~kvlib.read_cache.LayerRead`).

        With the read cache on, the result is a view of a dense mirror that later appends extend
        in place: use it before the next change to the store. ``mirror=False`` gathers without
        building a mirror (and keeps the layer's current one, for another batch).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        key = tuple(rows.tolist())
        cache = self._read_caches[layer]
        if cache is not None and cache.rows == key:
            return cache.view()
        lengths = self.tables[layer].lengths[rows]
        longest = int(lengths.max()) if lengths.numel() else 0
        if mirror and cache is not None and cache.rows and key[: len(cache.rows)] == cache.rows:
            joined = rows[len(cache.rows) :]  # sequences joined the mirrored batch: gather only them
            size = -(-int(lengths[len(cache.rows) :].max()) // self.page_size) * self.page_size
            cache.add_rows(tuple(joined.tolist()), self._gather(layer, joined, max(size, self.page_size)), lengths[len(cache.rows) :].clone())
            return cache.view()
        if not self.use_read_cache or not mirror:
            workspace = self._gather(layer, rows, longest)
            self.peak_workspace = max(self.peak_workspace, sum(t.nbytes for t in workspace))
            return workspace
        headroom = max(self.page_size, longest // 4)
        capacity = -(-(longest + headroom) // self.page_size) * self.page_size
        cache = DenseReadCache(key, self._gather(layer, rows, capacity), lengths, self.page_size)
        self._read_caches[layer] = cache
        return cache.view()

    def read_positions(self, layer: int, seqs: SequenceIds) -> LayerRead:
        """``seqs``' stored tokens of ``layer`` as :meth:`read` lays them out, without their keys
        and values: ``keys`` and ``values`` have no channels (``[batch, kv_heads, slots, 0]``);
        ``positions`` and ``valid`` are :meth:`read`'s. What an eviction strategy that scores by
        positions and attention needs after a call that attended over the pages (8 bytes a token)."""
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        batch, heads = lengths.shape
        size = int(lengths.max()) if lengths.numel() else 0
        pages = -(-size // self.page_size)
        ids = table.pages[rows][:, :, :pages].clamp(min=0).flatten()
        positions = pool.positions.index_select(0, to_arena_device(ids, self.device)).view(batch, heads, pages * self.page_size)[:, :, :size]
        valid = to_arena_device(torch.arange(size) < lengths.unsqueeze(-1), self.device)
        empty = torch.empty(batch, heads, size, 0, dtype=self.dtype, device=self.device)
        return LayerRead(empty, empty, positions.masked_fill(~valid, -1), valid)

    @outside_inference_mode
    def paged_layer(self, layer: int, seqs: SequenceIds) -> PagedLayer | None:
        """``seqs``' tokens of ``layer`` where they lie, for attention straight over the pages
        (:mod:`~kvlib.paged_attention`; coded pages are decoded inside the kernel; a tiered pool stages only its off-device pages, see
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

    def _pool_pages(self, layer: int, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """The pool's :meth:`~kvlib.storage.page_pool.PagePool.paged_layer`; what a tiered pool
        staged for it counts as a transient workspace (``peak_workspace``)."""
        pool = self.pools[layer]
        paged = pool.paged_layer(pages, lengths)
        self.peak_workspace = max(self.peak_workspace, pool.staged_bytes)
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
        rows = self._rows(seqs)
        table = self.tables[layer]
        lengths = table.lengths[rows]
        page_index = self._check_selection(table, lengths, page_index)
        past_end = torch.iinfo(torch.int64).max
        ordered = torch.where(page_index < 0, past_end, page_index).sort(-1).values
        chosen = ordered != past_end
        index = torch.where(chosen, ordered, 0)
        pages = torch.where(chosen, table.pages[rows].gather(2, index), -1)
        filled = torch.where(chosen, (lengths.unsqueeze(-1) - index * self.page_size).clamp(0, self.page_size), 0)
        return self._pool_pages(layer, pages, filled.sum(-1))

    def _check_selection(self, table: BlockTable, lengths: torch.Tensor, page_index: torch.Tensor) -> torch.Tensor:
        """``page_index`` on the CPU, once it names, per (sequence, head) of ``lengths [batch,
        kv_heads]``, pages the head holds or -1; else ``ValueError``."""
        batch, heads = lengths.shape
        if page_index.dim() != 3 or tuple(page_index.shape[:2]) != (batch, heads):
            raise ValueError(f"page_index must be [batch={batch}, kv_heads={heads}, k], got {list(page_index.shape)}")
        page_index = page_index.cpu()
        if bool(((page_index < -1) | (page_index >= table.pages_used(lengths).unsqueeze(-1))).any()):
            raise ValueError("page_index must name pages each head holds (0 <= j < pages used) or be -1")
        return page_index

    def _gather(self, layer: int, rows: torch.Tensor, size: int) -> LayerRead:
        """Gather ``rows`` from the pages into fresh dense tensors with ``size`` slots per head.

        Whole pages are gathered (one ``index_select`` of contiguous page rows per tensor); slots
        past each head's length are then zeroed and marked invalid.
        """
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        batch, heads = lengths.shape
        valid = torch.arange(size) < lengths.unsqueeze(-1)
        if pool.pages_in_use == 0:  # nothing stored: no page to gather from
            return LayerRead(
                torch.zeros(batch, heads, size, pool.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(batch, heads, size, pool.value_dim, dtype=self.dtype, device=self.device),
                torch.full((batch, heads, size), -1, dtype=torch.int64, device=self.device),
                valid.to(self.device),
            )
        pages = -(-size // self.page_size)
        page_ids = table.pages[rows][:, :, :pages]
        if page_ids.shape[2] < pages:
            page_ids = torch.nn.functional.pad(page_ids, (0, pages - page_ids.shape[2]), value=-1)
        ids = page_ids.clamp(min=0).flatten()
        slots = pages * self.page_size
        keys, values = pool.read_pages(ids)
        self._prefetch_following(layer, rows)
        keys = keys.view(batch, heads, slots, pool.head_dim)[:, :, :size]
        values = values.view(batch, heads, slots, pool.value_dim)[:, :, :size]
        positions = pool.positions.index_select(0, to_arena_device(ids, self.device)).view(batch, heads, slots)[:, :, :size]
        if not bool(valid.all()):
            invalid = to_arena_device(~valid, self.device)
            keys.masked_fill_(invalid.unsqueeze(-1), 0)
            values.masked_fill_(invalid.unsqueeze(-1), 0)
            positions.masked_fill_(invalid, -1)
        return LayerRead(keys, values, positions, to_arena_device(valid, self.device))

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
        rows = self._rows(seqs)
        summaries = self.pools[layer].summaries
        if summaries is None:
            raise ValueError("key_bounds needs a store made with key_summaries=True")
        table = self.tables[layer]
        pages_used = table.pages_used(table.lengths[rows])
        width = int(pages_used.max()) if pages_used.numel() else 0
        ids = to_arena_device(table.pages[rows][:, :, :width].clamp(min=0), self.device)
        return summaries.key_min[ids], summaries.key_max[ids], pages_used

    @outside_inference_mode
    def read_selected(self, layer: int, seqs: SequenceIds, page_index: torch.Tensor) -> LayerRead:
        """Only the chosen pages of each (sequence, head) of ``layer``, in dense form: a sparse read.

        ``page_index`` int64 ``[batch, kv_heads, k]`` (CPU) names pages by their index in each
        head's block table (``0 <= j < pages used``), ``-1`` for none. Returns a
        :class:`~kvlib.read_cache.LayerRead` of up to ``k * page_size`` slots per head: page ``i``
        of the selection fills slots ``[i * page_size, (i + 1) * page_size)``, slots past the
        head's length or of a ``-1`` entry are zero and invalid, and trailing slots invalid in
        every head are left out (a selection of every page reads what :meth:`read` does). Only the chosen pages are read (with a
        tiered pool, only chosen host pages are copied to the device); nothing moves or changes.
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        batch, heads = lengths.shape
        page_index = self._check_selection(table, lengths, page_index)
        chosen = page_index >= 0
        ids = table.pages[rows].gather(2, page_index.clamp(min=0))[chosen]
        size = page_index.shape[2] * self.page_size
        slot = page_index.clamp(min=0).unsqueeze(-1) * self.page_size + torch.arange(self.page_size)
        valid = (chosen.unsqueeze(-1) & (slot < lengths.view(batch, heads, 1, 1))).view(batch, heads, size)
        keys = torch.zeros(batch, heads, page_index.shape[2], self.page_size, pool.head_dim, dtype=self.dtype, device=self.device)
        values = torch.zeros(batch, heads, page_index.shape[2], self.page_size, pool.value_dim, dtype=self.dtype, device=self.device)
        positions = torch.full((batch, heads, page_index.shape[2], self.page_size), -1, dtype=torch.int64, device=self.device)
        if ids.numel():
            where = to_arena_device(chosen.flatten().nonzero().squeeze(-1), self.device)
            page_keys, page_values = pool.read_pages(ids)
            keys.view(-1, self.page_size, pool.head_dim).index_copy_(0, where, page_keys)
            values.view(-1, self.page_size, pool.value_dim).index_copy_(0, where, page_values)
            positions.view(-1, self.page_size).index_copy_(0, where, pool.positions.index_select(0, to_arena_device(ids, self.device)))
        held = valid.flatten(0, 1).any(0).nonzero()
        extent = int(held.max()) + 1 if held.numel() else 0  # trailing slots no head holds are left out
        invalid = to_arena_device(~valid, self.device)
        keys, values, positions = (
            keys.view(batch, heads, size, -1).masked_fill_(invalid.unsqueeze(-1), 0)[:, :, :extent],
            values.view(batch, heads, size, -1).masked_fill_(invalid.unsqueeze(-1), 0)[:, :, :extent],
            positions.view(batch, heads, size).masked_fill_(invalid, -1)[:, :, :extent],
        )
        return LayerRead(keys, values, positions, to_arena_device(valid[:, :, :extent], self.device))

    @outside_inference_mode
    def rank_pages(self, layer: int, seqs: SequenceIds, token_scores: torch.Tensor) -> None:
        """Rank the pages of ``seqs`` in ``layer`` for the device tier by ``token_scores`` (float
        ``[batch, kv_heads, slots]``, aligned with :meth:`read`'s slots; ``-inf`` for tokens that
        should not count): a page scores its best stored token, a page shared by several heads the
        best over them. The best-scored pages in use then sit on the device (see
        :meth:`~kvlib.storage.tiered_pool.TieredPagePool.rank`). Needs a tiered store."""
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pool, table = self.pools[layer], self.tables[layer]
        if not isinstance(pool, TieredPagePool):
            raise ValueError("rank_pages needs a tiered store (device_pages=...)")
        lengths = table.lengths[rows]
        if token_scores.dim() != 3 or tuple(token_scores.shape[:2]) != tuple(lengths.shape) or token_scores.shape[2] < int(lengths.max()):
            raise ValueError(f"token_scores must be [batch, kv_heads, >= {int(lengths.max())} slots], got {list(token_scores.shape)}")
        pages = int(table.pages_used(lengths).max())
        slots = pages * self.page_size
        scores = token_scores.float().cpu()[:, :, :slots]
        scores = torch.nn.functional.pad(scores, (0, slots - scores.shape[2]), value=float("-inf"))
        scores = scores.masked_fill(torch.arange(slots) >= lengths.unsqueeze(-1), float("-inf"))
        ids = table.pages[rows][:, :, :pages]
        held = ids >= 0
        pool.rank(ids[held], scores.view(*lengths.shape, pages, self.page_size).amax(-1)[held])

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
        batch, heads, steps = self._check_step(layer, rows, keys, values)
        index = torch.as_tensor(token_index, dtype=torch.int64).cpu()
        if index.dim() != 1 or index.numel() != steps:
            raise ValueError(f"token_index must be [tokens={steps}], got {list(index.shape)}")
        if steps and bool(((index < 0) | (index >= table.lengths[rows].min())).any()):
            raise ValueError("token_index must name stored tokens of every head")
        slots = table.flat_slots(rows, index.expand(batch, heads, steps))
        pages = torch.unique(slots // self.page_size)
        if bool((pool.refcount[pages] > 1).any()) or (isinstance(pool, CodedPagePool) and bool(pool.sealed[pages].any())):
            raise ValueError("overwrite needs pages held by these sequences alone and not sealed")
        positions = pool.positions.view(-1)[to_arena_device(slots.flatten(), self.device)]
        pool.write(slots.flatten(), keys.reshape(-1, pool.head_dim), values.reshape(-1, pool.value_dim), positions)
        self._drop_read_cache(layer, rows)

    # -- compaction ----------------------------------------------------------------------------

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

        - *slot reuse* (:mod:`~kvlib.slot_reuse`): kept tokens at slots ``>= k`` move into the
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
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        kept = sorted_keep(keep, lengths)
        new_lengths = (kept >= 0).sum(-1)
        changed = new_lengths != lengths
        if values is not None and tuple(values.shape) != (*kept.shape, pool.value_dim):
            raise ValueError(f"values must have shape {[*kept.shape, pool.value_dim]}, got {list(values.shape)}")
        if not bool(changed.any()):
            return kept
        width = kept.shape[-1]
        slot = torch.arange(width)
        in_place = (kept == slot).long().cumprod(-1).sum(-1)
        if values is not None:  # every kept value of a changed head may differ: rewrite it whole
            in_place = torch.zeros_like(in_place)
        first_page = in_place // self.page_size
        start = first_page * self.page_size
        plan = hole_fill(kept, lengths) if reuse_slots and values is None else None
        fill = torch.zeros_like(changed)
        if plan is not None:
            fill = self._fills_holes(layer, rows, plan, changed & (2 * plan.moves <= new_lengths - start), new_lengths)
        reorder = changed & ~fill
        if plan is not None and not bool(reorder.any()):  # a decode step's eviction: holes filled, nothing rewritten
            return self._fill_holes(layer, rows, plan, fill, lengths, new_lengths, kept)
        rewrite = reorder.unsqueeze(-1) & (slot >= start.unsqueeze(-1)) & (slot < new_lengths.unsqueeze(-1))

        old_pages_used, new_pages_used = table.pages_used(lengths), table.pages_used(new_lengths)
        page_slot = torch.arange(table.pages.shape[2])
        below_old = page_slot < old_pages_used.unsqueeze(-1)
        drop_page = reorder.unsqueeze(-1) & (page_slot >= first_page.unsqueeze(-1)) & below_old
        drop_page |= fill.unsqueeze(-1) & (page_slot >= new_pages_used.unsqueeze(-1)) & below_old
        dropped = table.pages[rows][drop_page]
        new_page_counts = torch.where(reorder, new_pages_used - first_page, 0).flatten()
        needed = int(new_page_counts.sum())
        unique, counts = torch.unique(dropped, return_counts=True)
        freed = int((pool.refcount[unique] == counts).sum())
        if not pool.can_allocate(needed - freed):
            raise PoolExhaustedError(f"layer {layer}: compaction needs {needed} pages, {pool.free_pages + freed} free")

        source = table.flat_slots(rows, kept.clamp(min=0))[rewrite]
        moved_keys, moved_values, moved_positions = pool.gather(source)
        if values is not None:
            moved_values = values.to(pool.device, pool.dtype)[rewrite.to(values.device)]
        moves = plan.only(fill) if plan is not None else None
        if moves is not None and moves[0].numel():
            b, h, hole, src = moves
            holes = table.pages[rows[b], h, hole // self.page_size] * self.page_size + hole % self.page_size
            filled = pool.gather(table.pages[rows[b], h, src // self.page_size] * self.page_size + src % self.page_size)
        pool.decref(dropped)
        b, h, j = drop_page.nonzero(as_tuple=True)
        table.pages[rows[b], h, j] = -1
        if needed:
            b, h, j = page_coordinates(first_page, new_page_counts, lengths.shape[1])
            table.pages[rows[b], h, j] = pool.allocate(needed, h)
        target = table.flat_slots(rows, torch.where(rewrite, slot, 0))[rewrite]
        pool.write(target, moved_keys, moved_values, moved_positions)
        if moves is not None and moves[0].numel():
            pool.write(holes, *filled)
        table.lengths[rows] = new_lengths
        sealed = table.sealed[rows]
        sealed = torch.where(reorder, sealed.clamp(max=first_page), sealed)
        table.sealed[rows] = torch.where(fill, torch.minimum(sealed, new_lengths // self.page_size), sealed)
        if pool.summaries is not None and bool(fill.any()):
            self._resummarize_filled_pages(layer, rows, fill, moves)
        self._open_pages[layer] = None
        self._mirror_compaction(layer, rows, reorder, moves, new_lengths)
        self.trim(layer)
        return kept if plan is None else torch.where(fill.unsqueeze(-1), plan.layout, kept)

    def _fill_holes(
        self, layer: int, rows: torch.Tensor, plan: HoleFill, fill: torch.Tensor, lengths: torch.Tensor, new_lengths: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`compact` when every changed head (``fill``) fills its holes: the moved tokens are
        written into the holes, pages past each head's new length are released, nothing is
        allocated or rewritten in order (what a decode step's eviction costs: a few small ops).
        Returns the layout."""
        pool, table = self.pools[layer], self.tables[layer]
        moves = plan.only(fill)
        b, h, hole, src = moves
        if b.numel():
            holes = table.pages[rows[b], h, hole // self.page_size] * self.page_size + hole % self.page_size
            sources = table.pages[rows[b], h, src // self.page_size] * self.page_size + src % self.page_size
            pool.write(holes, *pool.gather(sources))
        page_slot = torch.arange(table.pages.shape[2])
        drop_page = fill.unsqueeze(-1) & (page_slot >= table.pages_used(new_lengths).unsqueeze(-1)) & (page_slot < table.pages_used(lengths).unsqueeze(-1))
        db, dh, dj = drop_page.nonzero(as_tuple=True)
        if db.numel():
            pool.decref(table.pages[rows[db], dh, dj])
            table.pages[rows[db], dh, dj] = -1
        table.lengths[rows] = new_lengths
        sealed = table.sealed[rows]
        table.sealed[rows] = torch.where(fill, torch.minimum(sealed, new_lengths // self.page_size), sealed)
        if pool.summaries is not None:
            self._resummarize_filled_pages(layer, rows, fill, moves)
        self._open_pages[layer] = None
        self._mirror_compaction(layer, rows, torch.zeros_like(fill), moves, new_lengths)
        self.trim(layer)
        return torch.where(fill.unsqueeze(-1), plan.layout, kept)

    def _fills_holes(self, layer: int, rows: torch.Tensor, plan: HoleFill, cheap: torch.Tensor, new_lengths: torch.Tensor) -> torch.Tensor:
        """bool ``[batch, heads]``: the heads among ``cheap`` whose hole fill writes only pages
        writable in place (the holes' pages, and the new last page if it is partly kept: a
        truncated page is rewritten by later appends and its key summary redone)."""
        pool, table = self.pools[layer], self.tables[layer]
        fill = cheap.clone()
        b, h, hole, _ = plan.only(cheap)
        if b.numel():
            blocked = ~pool.writable(table.pages[rows[b], h, hole // self.page_size])
            fill[b[blocked], h[blocked]] = False
        b, h = (fill & (new_lengths % self.page_size != 0)).nonzero(as_tuple=True)
        if b.numel():
            blocked = ~pool.writable(table.pages[rows[b], h, new_lengths[b, h] // self.page_size])
            fill[b[blocked], h[blocked]] = False
        return fill

    def _resummarize_filled_pages(self, layer: int, rows: torch.Tensor, fill: torch.Tensor, moves: tuple[torch.Tensor, ...]) -> None:
        """Recompute the key summaries of the pages a hole fill wrote or cut short (heads ``fill``):
        each summary then covers only the tokens its page still holds."""
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        b, h, hole, _ = moves
        page = hole // self.page_size
        lb, lh = (fill & (lengths % self.page_size != 0)).nonzero(as_tuple=True)
        b, h, page = torch.cat([b, lb]), torch.cat([h, lh]), torch.cat([page, lengths[lb, lh] // self.page_size])
        ids, first = first_occurrences(table.pages[rows[b], h, page])
        if ids.numel() == 0:
            return
        held = (lengths[b, h] - page * self.page_size).clamp(max=self.page_size)[first]
        keys, _ = pool.read_pages(ids)
        pool.summaries.recompute(ids, keys, held)

    def _mirror_compaction(self, layer: int, rows: torch.Tensor, reorder: torch.Tensor, moves: tuple[torch.Tensor, ...] | None, new_lengths: torch.Tensor) -> None:
        """Keep the layer's read mirror in step with a compaction of ``rows``: patched (the tokens
        moved and vacated only) when every changed head of its rows filled holes, else dropped."""
        cache = self._read_caches[layer]
        if cache is None:
            return
        where = {seq: i for i, seq in enumerate(cache.rows)}
        mirror_row = torch.tensor([where.get(seq, -1) for seq in rows.tolist()], dtype=torch.int64)
        mirrored = mirror_row >= 0
        if not bool(mirrored.any()):
            return
        if bool(reorder[mirrored].any()):
            self._read_caches[layer] = None
            return
        lengths = cache.lengths.clone()
        lengths[mirror_row[mirrored]] = new_lengths[mirrored]
        b, h, hole, src = moves if moves is not None else (torch.zeros(0, dtype=torch.int64),) * 4
        inside = mirrored[b]
        cache.fill_holes(mirror_row[b[inside]], h[inside], hole[inside], src[inside], lengths)

    def trim(self, layer: int) -> None:
        """Give back ``layer``'s idle arena memory when less than :data:`TRIM_BELOW` of it is in
        use: pages in use at or past the new capacity (:func:`~kvlib.storage.page_pool.grown` of the pages in use) move to
        free pages below it, the block tables follow, and the arena is cut there. Nothing
        happens for pools that do not shrink (fixed, coded, tiered) or when something besides
        this store's block tables (a prefix index) holds pages of the layer, whose ids must stay."""
        layer = self._layer(layer)
        pool, table = self.pools[layer], self.tables[layer]
        used = pool.pages_in_use
        if not pool.shrinks or pool.capacity <= DEFAULT_PAGES_PER_LAYER or used >= pool.capacity * TRIM_BELOW:
            return
        held_by_tables = torch.bincount(table.pages[table.pages >= 0], minlength=pool.capacity)
        if not torch.equal(held_by_tables, pool.refcount):
            return
        capacity = max(grown(used), DEFAULT_PAGES_PER_LAYER)
        held = (pool.refcount > 0).nonzero().squeeze(-1)
        source = held[held >= capacity]
        target = (pool.refcount[:capacity] == 0).nonzero().squeeze(-1)[: source.numel()]
        pool.relocate(source, target)
        moved = torch.arange(pool.capacity)
        moved[source] = target
        table.pages = torch.where(table.pages >= 0, moved[table.pages.clamp(min=0)], -1)
        pool.shrink(capacity)
        self._open_pages[layer] = None

    # -- truncation ----------------------------------------------------------------------------

    @outside_inference_mode
    def truncate(self, layer: int, seqs: SequenceIds, length: int) -> None:
        """Forget every stored token of ``layer`` whose position is ``>= length``; set the logical
        length of ``seqs`` to at most ``length`` (what rolling back rejected draft tokens needs).

        The tokens dropped must be a suffix of each head (positions ascending, as appends give
        them); otherwise nothing changes and ``ValueError`` is raised. No token moves: pages past
        the new end are released, a partly kept page stays as it is (shared or not).
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length < 2**63:
            raise ValueError(f"length must be an int in [0, 2**63), got {length!r}")
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        positions = self.stored_positions(layer, rows)
        slot = torch.arange(positions.shape[-1])
        stored = slot < lengths.unsqueeze(-1)
        kept = stored & (positions < length)
        new_lengths = kept.sum(-1)
        if not bool((kept == (slot < new_lengths.unsqueeze(-1))).all()):
            raise ValueError(f"layer {layer}: tokens at positions >= {length} are not a suffix of every head")
        page_slot = torch.arange(table.pages.shape[2])
        drop = (page_slot >= table.pages_used(new_lengths).unsqueeze(-1)) & (
            page_slot < table.pages_used(lengths).unsqueeze(-1)
        )
        dropped = table.pages[rows][drop]
        reopen = self._pages_to_reopen(layer, rows, new_lengths)
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
        table.sealed[rows] = table.sealed[rows].clamp(max=new_lengths // self.page_size)
        if reopen is not None:
            self._reopen(layer, rows, reopen)
        if pool.summaries is not None:
            self._resummarize_last_pages(layer, rows, new_lengths != lengths)
        self._open_pages[layer] = None
        cache = self._read_caches[layer]
        if cache is not None and cache.rows == tuple(rows.tolist()):
            cache.truncate(new_lengths)
        else:
            self._drop_read_cache(layer, rows)

    def _pages_to_reopen(self, layer: int, rows: torch.Tensor, new_lengths: torch.Tensor) -> torch.Tensor | None:
        """bool ``[batch, heads]``: heads a truncation to ``new_lengths`` leaves in the middle of a
        sealed or shared page (None without a codec or key summaries). Such a head gets an open,
        private copy of that page, so that appends can write after it, a sharer for which the page
        is still full may seal it without sealing a partial page, and the copy's key summary
        covers only the tokens its head holds."""
        pool, table = self.pools[layer], self.tables[layer]
        if not isinstance(pool, CodedPagePool) and pool.summaries is None:
            return None
        partial = new_lengths % self.page_size != 0
        last_index = torch.where(partial, new_lengths // self.page_size, 0)
        last = table.pages[rows].gather(2, last_index.unsqueeze(-1)).squeeze(-1)
        shared = pool.refcount[last[partial]] > 1
        partial[partial.clone()] = pool.sealed[last[partial]] | shared if isinstance(pool, CodedPagePool) else shared
        return partial

    def _reopen(self, layer: int, rows: torch.Tensor, reopen: torch.Tensor) -> None:
        """Replace the last page of each head in ``reopen`` by an open, private copy (see :meth:`_pages_to_reopen`)."""
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        b, h = reopen.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        old = table.pages[rows[b], h, lengths[b, h] // self.page_size]
        new = pool.allocate(b.numel(), h)
        if isinstance(pool, CodedPagePool):
            pool.open_copies(old, new)
        else:  # a summarized pool: the copy's summary is redone by the truncation
            pool.copy_pages(old, new)
        pool.decref(old)
        table.pages[rows[b], h, lengths[b, h] // self.page_size] = new

    def _resummarize_last_pages(self, layer: int, rows: torch.Tensor, changed: torch.Tensor) -> None:
        """Recompute the key summaries of the partly filled last pages of the heads ``changed``
        (bool ``[batch, heads]``) from the tokens they still hold (after a truncation; such pages
        are private by then, see :meth:`_pages_to_reopen`)."""
        pool, table = self.pools[layer], self.tables[layer]
        lengths = table.lengths[rows]
        partial = changed & (lengths % self.page_size != 0)
        b, h = partial.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        ids = table.pages[rows[b], h, lengths[b, h] // self.page_size]
        keys, _ = pool.read_pages(ids)
        pool.summaries.recompute(ids, keys, lengths[b, h] % self.page_size)

    # -- sealing -------------------------------------------------------------------------------

    @outside_inference_mode
    def seal(self, layer: int, seqs: SequenceIds) -> int:
        """Encode every full, open page of ``seqs`` in ``layer`` with the layer's codec; returns
        how many pages were sealed (0 without codecs, or while the codec is not yet fitted).

        Sealed pages then hold only the codec's fields; later reads decode them.
        """
        layer = self._layer(layer)
        rows = self._rows(seqs)
        pool, table = self.pools[layer], self.tables[layer]
        if isinstance(pool, PartneredPagePool):
            return self._seal_pairs(layer, rows)
        if not isinstance(pool, CodedPagePool) or not pool.codec.ready:
            return 0
        full = table.lengths[rows] // self.page_size
        done = table.sealed[rows]
        if not bool((full > done).any()):
            return 0
        page_slot = torch.arange(table.pages.shape[2])
        candidate = (page_slot >= done.unsqueeze(-1)) & (page_slot < full.unsqueeze(-1))
        ids = torch.unique(table.pages[rows][candidate])
        ids = ids[~pool.sealed[ids]]
        pool.seal(ids)
        table.sealed[rows] = full
        if ids.numel():
            self._drop_read_cache(layer, rows)
        return int(ids.numel())

    def _seal_pairs(self, deep: int, rows: torch.Tensor) -> int:
        """Seal the full pages of layer ``deep`` together with the pages of its partner layer that
        hold the same tokens (same page index and positions, both open); each pair is encoded by
        the deep layer's codec at once. Pages without such a partner stay open. Returns the pairs
        sealed. ``sealed`` counters of ``deep`` then mean "considered", not "sealed"."""
        shallow = self.partners[deep]
        pool, partner_pool = self.pools[deep], self.pools[shallow]
        table, partner_table = self.tables[deep], self.tables[shallow]
        full = torch.minimum(table.lengths[rows], partner_table.lengths[rows]) // self.page_size
        done = table.sealed[rows]
        if not bool((full > done).any()):
            return 0
        width = min(table.pages.shape[2], partner_table.pages.shape[2])
        page_slot = torch.arange(width)
        candidate = (page_slot >= done.unsqueeze(-1)) & (page_slot < full.unsqueeze(-1))
        ids = table.pages[rows][:, :, :width][candidate]
        partner_ids = partner_table.pages[rows][:, :, :width][candidate]
        table.sealed[rows] = torch.maximum(done, full)
        open_pair = ~pool.sealed[ids] & ~partner_pool.sealed[partner_ids]
        ids, partner_ids = ids[open_pair], partner_ids[open_pair]
        if ids.numel() == 0:
            return 0
        same = (pool.positions[to_arena_device(ids, self.device)] == partner_pool.positions[to_arena_device(partner_ids, self.device)]).all(-1)
        ids, partner_ids = ids[same.cpu()], partner_ids[same.cpu()]
        _, first = first_occurrences(ids)
        ids, partner_ids = ids[first], partner_ids[first]
        _, first = first_occurrences(partner_ids)  # a page pairs with one partner only
        ids, partner_ids = ids[first], partner_ids[first]
        if ids.numel() == 0:
            return 0
        shallow_fields, deep_fields = pool.codec.merge(partner_pool.raw_pages(partner_ids), pool.raw_pages(ids))
        partner_pool.seal(partner_ids, shallow_fields)
        pool.seal_pairs(ids, partner_ids, deep_fields)
        self._drop_read_cache(deep, rows)
        self._drop_read_cache(shallow, rows)
        return int(ids.numel())

    @outside_inference_mode
    def stored_positions(self, layer: int, seqs: SequenceIds) -> torch.Tensor:
        """Positions of the stored tokens of ``seqs``: int64 ``[batch, heads, longest]`` on the CPU,
        -1 past each head's length (read from the arena without touching keys or values)."""
        layer = self._layer(layer)
        rows = self._rows(seqs)
        table = self.tables[layer]
        lengths = table.lengths[rows]
        longest = int(lengths.max()) if lengths.numel() else 0
        token_index = torch.arange(longest).expand(*lengths.shape, longest)
        stored = token_index < lengths.unsqueeze(-1)
        slots = torch.where(stored, table.flat_slots(rows, token_index), 0)
        flat = self.pools[layer].positions.view(-1)
        positions = flat[to_arena_device(slots, self.device)].cpu() if longest else slots
        return torch.where(stored, positions, -1)

    # -- memory --------------------------------------------------------------------------------

    def bytes_in_use(self) -> int:
        """Bytes held by pages in use across all layers (keys, values, positions)."""
        return sum(pool.bytes_in_use() for pool in self.pools)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held, by component: ``pages`` (keys and values of pages in use: compute dtype for
        open pages, the codec's payload for sealed ones; on every tier), ``host`` and ``disk``
        (the parts of ``pages`` held in host memory and spilled to disk), ``positions``, ``codec_metadata`` (scales, zero points and
        fitted codec state),
        ``tables`` (block tables and lengths), ``read_cache`` (dense mirrors) and ``reserved``
        (whole arenas, free pages included)."""
        tables = sum(
            sum(t.numel() * t.element_size() for t in (table.pages, table.lengths, table.logical, table.sealed))
            for table in self.tables
        )
        return {
            "pages": self._page_bytes(),
            "positions": sum(pool.pages_in_use * pool.position_page_bytes for pool in self.pools),
            "codec_metadata": sum(pool.metadata_bytes() for pool in self.pools),
            "host": sum(pool.tier_bytes()["host"] for pool in self.pools if isinstance(pool, TieredPagePool)),
            "disk": sum(pool.tier_bytes()["disk"] for pool in self.pools if isinstance(pool, TieredPagePool)),
            "tables": tables,
            "read_cache": sum(cache.nbytes() for cache in self._read_caches if cache is not None),
            "reserved": sum(pool.bytes_reserved() for pool in self.pools),
        }

    def _page_bytes(self) -> int:
        return sum(pool.data_bytes() for pool in self.pools)

    # -- validation helpers ----------------------------------------------------------------------

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def _rows(self, seqs: SequenceIds) -> torch.Tensor:
        ids = tuple(seqs.tolist() if isinstance(seqs, torch.Tensor) else seqs)
        if self._last_rows is not None and ids == self._last_rows[0] and all(type(s) is int for s in ids):
            return self._last_rows[1]
        if not ids:
            raise ValueError("at least one sequence id is needed")
        unknown = [s for s in ids if type(s) is not int or s not in self._live]
        if unknown:
            raise ValueError(f"unknown or released sequence ids {list(unknown)}; live ids: {self.sequences}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"sequence ids repeat in one batch: {list(ids)}")
        rows = torch.tensor(ids, dtype=torch.int64)
        self._last_rows = (ids, rows)
        return rows

    def _check_step(
        self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[int, int, int]:
        pool, heads = self.pools[layer], self.tables[layer].num_heads
        check_tensor("keys", keys, self.dtype, self.device)
        check_tensor("values", values, self.dtype, self.device)
        expect_k = (len(rows), heads, keys.shape[2] if keys.dim() == 4 else -1, pool.head_dim)
        if keys.dim() != 4 or tuple(keys.shape) != expect_k:
            raise ValueError(
                f"layer {layer}: keys must be [batch={len(rows)}, kv_heads={heads}, tokens, head_dim={pool.head_dim}],"
                f" got {list(keys.shape)}"
            )
        expect_v = (*expect_k[:3], pool.value_dim)
        if values.dim() != 4 or tuple(values.shape) != expect_v:
            raise ValueError(f"layer {layer}: values must be {list(expect_v)}, got {list(values.shape)}")
        return len(rows), heads, keys.shape[2]

    def _step_positions(
        self,
        table: BlockTable,
        rows: torch.Tensor,
        positions: torch.Tensor | None,
        batch: int,
        heads: int,
        steps: int,
    ) -> torch.Tensor:
        """Positions of a step as int64 ``[batch, heads, steps]`` on the store's device."""
        if positions is None:
            positions = table.logical[rows].unsqueeze(-1) + torch.arange(steps)
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError("positions must be an integer tensor of shape [batch, tokens] or [tokens]")
        if positions.dim() == 1 and positions.shape[0] == steps:
            positions = positions.unsqueeze(0).expand(batch, steps)
        if tuple(positions.shape) != (batch, steps):
            raise ValueError(f"positions must have shape [{batch}, {steps}] or [{steps}], got {list(positions.shape)}")
        return positions.to(self.device, torch.int64).unsqueeze(1).expand(batch, heads, steps)

    def _drop_read_cache(self, layer: int, rows: torch.Tensor) -> None:
        cache = self._read_caches[layer]
        if cache is not None and not set(cache.rows).isdisjoint(rows.tolist()):
            self._read_caches[layer] = None


def initial_arena_bytes(
    keys_dim: Sequence[int],
    values_dim: Sequence[int],
    page_size: int,
    dtype: torch.dtype,
    pages_per_layer: int,
    *,
    coded: bool = False,
    tiered: bool = False,
) -> int:
    """Bytes a store's page arenas take when it is built (at most, when ``tiered``): per layer
    (one entry of ``keys_dim`` and ``values_dim`` each), int64 positions of ``pages_per_layer``
    pages, and keys and values in ``dtype`` of ``pages_per_layer`` pages; of ``FIRST_ROWS`` when
    ``coded`` (the raw rows of open pages); of up to ``max(pages_per_layer, FIRST_ROWS)`` device
    and ``FIRST_ROWS`` host rows when ``tiered``. Read mirrors and a codec's fields come later,
    with the tokens."""
    item = torch.empty((), dtype=dtype).element_size()
    rows = pages_per_layer
    if coded:
        rows = FIRST_ROWS
    elif tiered:
        rows = max(pages_per_layer, FIRST_ROWS) + FIRST_ROWS
    per_slot = sum(rows * (k + v) * item + pages_per_layer * 8 for k, v in zip(keys_dim, values_dim))
    return per_slot * page_size


def _per_layer(name: str, value: int | Sequence[int], num_layers: int) -> list[int]:
    values = [value] * num_layers if isinstance(value, int) else list(value)
    if len(values) != num_layers or not all(isinstance(v, int) and v > 0 for v in values):
        raise ValueError(f"{name} must be a positive int or {num_layers} positive ints, got {value!r}")
    return values
