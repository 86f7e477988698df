"""What one layer of the paged store owns, and the base of the parts of its object.

:class:`~kvlib.storage.layers.layer_pages.LayerPages` is one layer of a
:class:`~kvlib.storage.store.paged_store.PagedStore`: its page pool (keys, values and each stored
token's position, on one or more tiers), its block table (per sequence row and KV head, the page
ids, the stored and logical lengths, how many pages were considered for sealing) and where the
last append's batch writes next. Its operations are written in one module per job
(:mod:`~kvlib.storage.layers.layer_writes`, :mod:`~kvlib.storage.layers.layer_reads`,
:mod:`~kvlib.storage.layers.layer_compaction`, :mod:`~kvlib.storage.layers.layer_truncation`,
:mod:`~kvlib.storage.layers.layer_sealing`), each a class over this state.

Invariant: every block-table entry ``>= 0`` names a page in use in ``pool``, and a page's
reference count is at least the number of entries naming it (more where a prefix index or
another holder keeps it).
"""

from __future__ import annotations

from kvlib.storage.layers.block_table import BlockTable
from kvlib.storage.layers.open_pages import OpenPages
from kvlib.storage.pools.page_pool import PagePool


class LayerState:
    """One layer's ``pool``, block ``table`` and ``open_pages``; ``layer`` is its index (for messages)."""

    def __init__(self, layer: int, pool: PagePool, table: BlockTable) -> None:
        self.layer = layer
        self.pool = pool
        self.table = table
        self.open_pages: OpenPages | None = None
        """Where the last append's batch writes next (None: the next append takes the general path)."""

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.pool.page_size
