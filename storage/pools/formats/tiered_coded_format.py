"""The tiered coded page format: sealed pages held encoded that move, still encoded, between device, host and disk.

A :class:`~kvlib.storage.pools.formats.coded_format.CodedPages` whose sealed pages' fields do not lie in
field arenas indexed by page id but in ``tiers``, a pool of byte pages of the
:class:`~kvlib.storage.pools.formats.tiered_format.TieredPages` format (the budgets are a :class:`~kvlib.storage.pools.formats.tiered_format.TierBudgets`): each sealed page is one page there (``tier_page[page]``) whose key row and value
row hold the codec's fields packed (:class:`~kvlib.storage.pools.formats.field_rows.FieldRows`). That pool
moves them between the device (at most ``device_pages`` sealed pages), the host (at most
``host_pages``) and disk (records of a layer spill, at most ``disk_pages``) in the placement's
order, as the encoded bytes they are: nothing is decoded on the way. Reads decode them where
they are read: :meth:`read_pages` from wherever they lie, the paged kernel (CPU) in place from
the device rows and the off-device pages a block table names staged after them
(:meth:`paged_layer`).

Open pages (each head's last, partly filled page, in the compute dtype) stay on the device, in
the raw arena, and do not count against ``device_pages``. The tier pool is built at the first
seal (a fitted codec knows its fields only once fitted).

Invariants (beside :class:`~kvlib.storage.pools.formats.coded_format.CodedPages`' and the tier pool's): a
page in use is sealed exactly when ``tier_page[page] >= 0``; the tier pool's pages in use are
exactly the sealed pages' ``tier_page``, each referenced once; a free page has ``tier_page -1``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlib.codec import PageCodec
from kvlib.devices import PagedKernel, paged_kernel
from kvlib.kernels.paged_attention import coded_source
from kvlib.kernels.pages import PagedLayer
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.formats.field_rows import FieldRows
from kvlib.storage.pools.formats.page_format import extend_rows
from kvlib.storage.pools.formats.tiered_format import TierBudgets, TieredPages
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.tiers.spill_store import LayerSpill

SpillLayer = Callable[[FieldRows], LayerSpill]
"""Makes the layer spill of a pool's sealed pages, given how their fields pack into rows."""


class TieredCodedPages(CodedPages):
    """A :class:`CodedPages` keeping at most ``budgets.device_pages`` sealed pages on its pool's
    device, the rest on the host and, with ``spill_layer``, on disk, moved encoded (see the
    module docstring)."""

    def __init__(self, codec: PageCodec, budgets: TierBudgets, spill_layer: SpillLayer | None = None) -> None:
        if spill_layer is not None:
            budgets.check_disk()
        super().__init__(codec)
        self.budgets = budgets
        self.device_pages = budgets.device_pages
        self.host_pages = budgets.host_pages
        self.disk_pages = budgets.disk_pages if spill_layer is not None else 0
        self._spill_layer = spill_layer

    def create(self, capacity: int) -> None:
        super().create(capacity)
        self.tier_page = torch.full((capacity,), -1, dtype=torch.int64)
        """Per page id (int64, CPU): a sealed page's page in :attr:`tiers` (-1: open or free)."""
        self.tiers: PagePool | None = None
        """The sealed pages' fields as byte pages on their tiers (None before the first seal)."""
        self.field_rows: FieldRows | None = None
        """How the codec's fields pack into a tier page's rows (None before the first seal)."""
        self.staged_bytes = 0
        """Encoded bytes the last :meth:`paged_layer` staged (its transient workspace)."""

    def grow(self, capacity: int) -> None:
        super().grow(capacity)
        self.tier_page = extend_rows(self.tier_page, capacity, -1)

    def _tier_pool(self) -> PagePool:
        """:attr:`tiers`, built on first use (the codec is fitted by then: it seals)."""
        if self.tiers is None:
            rows = FieldRows.of(self.codec.fields)
            spill = None if self._spill_layer is None else self._spill_layer(rows)
            self.tiers = PagePool(
                page_size=1,
                head_dim=rows.key_bytes,
                value_dim=rows.value_bytes,
                dtype=torch.uint8,
                device=self.device,
                capacity=self.pool.capacity,
                format=TieredPages(self.budgets, spill),
            )
            self.field_rows = rows
        return self.tiers

    # -- tiers ---------------------------------------------------------------------------------

    @property
    def pages_on_device(self) -> int:
        """Pages whose bytes are on the device: open pages and sealed pages there."""
        return self.open_pages + (0 if self.tiers is None else self.tiers.pages_on_device)

    @property
    def pages_on_host(self) -> int:
        return 0 if self.tiers is None else self.tiers.pages_on_host

    @property
    def pages_on_disk(self) -> int:
        return 0 if self.tiers is None else self.tiers.pages_on_disk

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of pages held on each tier: open pages in the compute dtype (on the device) and
        sealed pages at the codec's bytes (fields and metadata) wherever they lie."""
        coded = self.codec.page_bytes() if self.tiers is not None else 0
        return {
            "device": self.open_pages * self.pool.kv_page_bytes + (self.pages_on_device - self.open_pages) * coded,
            "host": self.pages_on_host * coded,
            "disk": self.pages_on_disk * coded,
        }

    def bytes_reserved(self) -> int:
        tiers = 0 if self.tiers is None else self.tiers.bytes_reserved()
        return self.keys.shape[0] * self.pool.kv_page_bytes + tiers + self.pool.capacity * self.pool.position_page_bytes

    def rank(self, ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Give pages ``ids`` placement ``scores`` (see :meth:`TieredPages.rank`); open pages
        among them are on the device anyway and are left out."""
        sealed = self.sealed[ids]
        if self.tiers is not None and bool(sealed.any()):
            self.tiers.rank(self.tier_page[ids[sealed]], scores[sealed])

    def prefetch(self, ids: torch.Tensor, prefetcher: PagePrefetcher) -> None:
        """Start fetching the sealed pages among ``ids`` that are off the device (see :meth:`TieredPages.prefetch`)."""
        if self.tiers is not None:
            self.tiers.prefetch(self.tier_page[ids[self.sealed[ids]]], prefetcher)

    # -- sealed pages --------------------------------------------------------------------------

    def _store_sealed(self, ids: torch.Tensor, encoded: dict[str, torch.Tensor]) -> None:
        """Put the pages' ``encoded`` fields on the tiers, one new tier page each (written through
        the device, which may move other sealed pages off it)."""
        self._tier_pool()
        key_rows, value_rows = self.field_rows.pack(encoded)
        self._write_tier_pages(ids, key_rows, value_rows)

    def _write_tier_pages(self, ids: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor) -> None:
        """Give pages ``ids`` new tier pages holding rows ``key_rows`` / ``value_rows`` (``[n, 1,
        bytes]``); if the tiers cannot take them, nothing is held for them and the error propagates."""
        tiers = self.tiers
        tier_ids = tiers.allocate(ids.numel())
        try:
            tiers.write(tier_ids, key_rows.view(ids.numel(), -1), value_rows.view(ids.numel(), -1), ids)
        except BaseException:
            tiers.decref(tier_ids)
            raise
        self.tier_page[ids] = tier_ids

    def record_pages(self, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The encoded fields of sealed pages ``ids`` read from whichever tier holds them (no page
        moves), as :meth:`CodedPages.record_pages` gives them; None unless every one is sealed."""
        if ids.numel() == 0 or self.tiers is None or self.record_fields() is None or not bool(self.sealed[ids].all()):
            return None
        key_rows, value_rows = self.tiers.read_pages(self.tier_page[ids])
        return {name: t.contiguous() for name, t in self.field_rows.views(key_rows, value_rows).items()}

    def _copy_sealed(self, source: torch.Tensor, target: torch.Tensor) -> None:
        key_rows, value_rows = self.tiers.read_pages(self.tier_page[source])
        self._write_tier_pages(target, key_rows, value_rows)

    def freed(self, ids: torch.Tensor) -> None:
        held = self.tier_page[ids]
        held = held[held >= 0]
        if held.numel():
            self.tiers.decref(held)
        self.tier_page[ids] = -1
        super().freed(ids)

    def _decode_sealed(
        self, pages: torch.Tensor, heads: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Read sealed ``pages``' rows from their tiers (no page moves) and decode them into ``keys[rows]`` / ``values[rows]``."""
        key_rows, value_rows = self.tiers.read_pages(self.tier_page[pages])
        fields = {name: t.contiguous() for name, t in self.field_rows.views(key_rows, value_rows).items()}
        self.codec.decode_into(fields, torch.arange(pages.numel()), heads, keys, values, rows)

    # -- attention -----------------------------------------------------------------------------

    def page_source(self) -> None:
        """None: sealed pages may be off the device (attention reads them through :meth:`paged_layer`)."""
        return None

    def paged_layer(self, pages: torch.Tensor, lengths: torch.Tensor) -> PagedLayer | None:
        """A block table's tokens where the CPU page kernel reads them (see
        :meth:`~kvlib.storage.pools.page_pool.PagePool.paged_layer`): the sealed pages' fields as views
        of the tier pool's device rows followed by its off-device pages the table names, staged
        (:meth:`TieredPages.staged_arenas`, encoded: the kernel decodes them); open pages in
        the raw arena, numbered after those rows. None off the CPU, for a codec not fitted yet or
        without page loaders (attention then reads through :meth:`read_pages`)."""
        if not self.codec.ready or paged_kernel(self.device) is not PagedKernel.NUMBA:
            return None
        held = pages >= 0
        ids = pages[held]
        sealed = self.sealed[ids]
        if self.tiers is None:
            fields, sealed_rows = self._field_arenas(0), torch.zeros_like(ids)
            self.staged_bytes = 0
        else:
            key_arena, value_arena, _, sealed_rows = self.tiers.staged_arenas(torch.where(sealed, self.tier_page[ids], -1))
            fields = self.field_rows.views(key_arena, value_arena)
            self.staged_bytes = self.tiers.staged_bytes
        readers = self.codec.kernel_readers(fields)
        if readers is None:
            return None
        first_open = next(iter(fields.values())).shape[0]
        opened, slot = torch.unique(ids[~sealed], return_inverse=True)
        rows = torch.where(sealed, sealed_rows, first_open)
        rows[~sealed] += slot
        count = first_open + opened.numel()
        is_sealed = torch.zeros(count, dtype=torch.bool)
        is_sealed[:first_open] = True
        raw_row = torch.full((count,), -1, dtype=torch.int64)
        raw_row[first_open:] = self.raw_row[opened]
        positions = torch.zeros(count, self.page_size, dtype=torch.int64)
        positions[rows] = self.pool.positions[ids]
        source = coded_source(self.keys, self.values, is_sealed, raw_row, positions, *readers)
        table = torch.full_like(pages, -1)
        table[held] = rows
        return PagedLayer(source, table, lengths)
