"""One layer of the paged store as one object: :class:`LayerPages`.

It owns the layer's pool (page arenas of keys, values and each stored token's original
position, on one or more tiers), its block table (per sequence row and KV head: page ids,
stored and logical lengths, pages considered for sealing) and where the last append's batch
writes next; its methods are the store's operations on one layer, each job written in its own
module: :class:`~kvlib.storage.layers.layer_writes.LayerWrites` (appends, copy-on-write, room for
planned steps, overwrites), :class:`~kvlib.storage.layers.layer_reads.LayerReads` (dense, positional
and sparse reads, page selections, key bounds, page scores),
:class:`~kvlib.storage.layers.layer_compaction.LayerCompaction` (compaction, trimming),
:class:`~kvlib.storage.layers.layer_truncation.LayerTruncation` and
:class:`~kvlib.storage.layers.layer_sealing.LayerSealing`. A
:class:`~kvlib.storage.store.paged_store.PagedStore` holds one per layer and adds what spans layers
(sequence ids, read caches, step plans, prefetch, memory accounting).

Invariants (besides :mod:`~kvlib.storage.layers.layer_state`'s): the methods take block-table rows
(int64 ``[batch]``, validated by the store) and leave the layer unchanged when they raise; only
:meth:`~kvlib.storage.layers.layer_sealing.LayerSealing.seal` reads another layer (its partner's table).
"""

from __future__ import annotations

import torch

from kvlib.storage.layers.block_table import BlockTable
from kvlib.storage.layers.layer_compaction import LayerCompaction
from kvlib.storage.layers.layer_sealing import LayerSealing
from kvlib.storage.layers.layer_truncation import LayerTruncation
from kvlib.storage.layers.layer_writes import LayerWrites


class LayerPages(LayerWrites, LayerTruncation, LayerCompaction, LayerSealing):
    """One layer's pool, block table and open pages, with the store's operations on them."""

    def attach_prefix(self, row: torch.Tensor, pages: torch.Tensor, seq: int) -> None:
        """Give the empty row ``row`` (int64 ``[1]``, sequence ``seq``) the full pages ``pages``
        (int64 ``[kv_heads, n]``, in use) as its first ``n * page_size`` tokens, by reference;
        ``ValueError`` before any change for a row that holds tokens or pages of the wrong shape."""
        pool, table = self.pool, self.table
        if int(table.lengths[row].sum()) or int(table.logical[row].sum()):
            raise ValueError(f"attach_prefix needs an empty sequence; {seq} holds tokens in layer {self.layer}")
        if pages.dim() != 2 or pages.shape[0] != table.num_heads:
            raise ValueError(f"pages must be [kv_heads={table.num_heads}, n], got {list(pages.shape)}")
        count = pages.shape[1]
        pool.incref(pages.flatten())
        table.ensure_pages(count)
        table.pages[row, :, :count] = pages
        table.lengths[row] = count * self.page_size
        table.logical[row] = count * self.page_size

    def fork_row(self, source: int, target: int) -> None:
        """Make row ``target`` share every page of row ``source`` by reference (copy-on-write)."""
        self.table.copy_row(source, target)
        self.pool.incref(self.table.referenced_pages(torch.tensor([target])))

    def release(self, rows: torch.Tensor) -> None:
        """Release the page references of ``rows`` and clear their block-table rows."""
        self.pool.decref(self.table.referenced_pages(rows))
        self.table.clear(rows)

    def reset_table(self) -> None:
        """A new store's block table (no rows, one page column): for a store with no live sequence."""
        self.table = BlockTable(self.table.num_heads, self.page_size)
        self.open_pages = None

    def table_bytes(self) -> int:
        """Bytes of the block table (page ids, lengths, logical lengths, sealed counters)."""
        table = self.table
        return sum(part.numel() * part.element_size() for part in (table.pages, table.lengths, table.logical, table.sealed))
