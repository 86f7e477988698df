"""The state of a :class:`~kvlib.storage.store.paged_store.PagedStore` and what every part of it uses.

:class:`StoreState` builds the store (one :class:`~kvlib.storage.layers.layer_pages.LayerPages` per
layer, the read caches, the sequence ids) and answers what spans layers without changing
anything: lengths, the cached rows, bytes held; and it validates layer indices and sequence ids
(:meth:`StoreState._layer`, :meth:`StoreState._rows`) for the parts built on it
(:class:`~kvlib.storage.store.store_reads.StoreReads`, :class:`~kvlib.storage.store.paged_store.PagedStore`).
"""

from __future__ import annotations

import torch

from kvlib.devices import outside_inference_mode
from kvlib.storage.layers.block_table import BlockTable
from kvlib.storage.layers.layer_pages import LayerPages
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.store.pool_factory import build_pools
from kvlib.storage.store.read_caches import ReadCaches
from kvlib.storage.store.step_plan import DecodeLayout
from kvlib.storage.store.store_config import StoreConfig
from kvlib.storage.store.store_sequences import SequenceIds, SequenceRows
from kvlib.storage.tiers.spill_store import SpillStore


class StoreState:
    """A paged store's layers, read caches and sequence ids (the arguments: :class:`~kvlib.storage.store.paged_store.PagedStore`)."""

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

    @property
    def pools(self) -> list[PagePool]:
        """Each layer's page pool (:attr:`LayerPages.pool <kvlib.storage.layers.layer_state.LayerState.pool>`)."""
        return [pages.pool for pages in self.layers]

    @property
    def tables(self) -> list[BlockTable]:
        """Each layer's block table (:attr:`LayerPages.table <kvlib.storage.layers.layer_state.LayerState.table>`)."""
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
