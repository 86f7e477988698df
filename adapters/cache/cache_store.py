"""``CacheStoreBuilder``: how a :class:`~kvlib.adapters.KVCache` builds its paged store.

The store follows from the model's KV shape, the page size, the read mirror, the codec (its
per-layer codecs are built with the store) and the tiering policy (pages kept on the device
and the host, and where a disk tier spills them), in the compute dtype on the compute device.
A cache living in a :class:`~kvlib.PrefixStore` uses that store's paged store for its namespace
instead (built the same way the first time).
"""

from __future__ import annotations

import torch

from kvlib.codec import Codec, PageCodec, layer_shapes
from kvlib.errors import DiskTierUnavailable
from kvlib.model_shape import KVShape
from kvlib.policy import Tiering
from kvlib.storage.pools.formats.field_rows import FieldRows
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.prefix.prefix_store import PrefixStore
from kvlib.storage.records.spilled_page_record import Layout, record_size
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.open_tiers import open_disk_tier
from kvlib.storage.tiers.spill_store import SpillStore


class CacheStoreBuilder:
    """Builds a cache's store; keeps what outlives one store: the per-layer ``codecs`` of the
    last store built (None without a codec) and the cache's ``spill`` store (one per cache, opened
    with its first store when the tiering policy names a disk).

    Raises ``ValueError`` at construction when the tiering policy names a directory that cannot
    hold a disk tier (spilled pages would have nowhere to go)."""

    def __init__(
        self,
        shape: KVShape,
        *,
        page_size: int,
        read_cache: bool,
        codec: Codec | None,
        tiering: Tiering | None,
        reuse: PrefixStore | None,
        spec: str,
    ) -> None:
        self.shape = shape
        self.page_size = page_size
        self.read_cache = read_cache
        self.codec = codec
        self.tiering = tiering
        self.reuse = reuse
        self.spec = spec
        self.codecs: list[PageCodec | None] | None = None
        self.spill: SpillStore | None = None
        """The cache's spilled pages on disk (opened with the store; records deleted as pages
        are freed, all of them when the cache is garbage collected or the process exits)."""
        self._spill_tier = _spill_tier(tiering)

    def new_store(self, dtype: torch.dtype, device: torch.device) -> PagedStore:
        """The store for a cache computing in ``dtype`` on ``device``: the PrefixStore's for this
        cache's namespace (an unprimed cache indexes nothing), else a new one."""
        if self.reuse is not None:
            return self.shared_store(dtype, device)
        return self._build_store(dtype, device)

    def namespace(self, dtype: torch.dtype, device: torch.device) -> str:
        """This cache's namespace in its PrefixStore."""
        return self.reuse.namespace(self.spec, dtype, device, self.page_size)

    def shared_store(self, dtype: torch.dtype, device: torch.device) -> PagedStore:
        """The PrefixStore's paged store for this cache's namespace (its codecs are the store's)."""
        store = self.reuse.paged_store(self.namespace(dtype, device), lambda: self._build_store(dtype, device))
        if self.codec is not None:
            self.codecs = [getattr(pool, "codec", None) for pool in store.pools]
        return store

    def _build_store(self, dtype: torch.dtype, device: torch.device) -> PagedStore:
        shape = self.shape
        if self.codec is not None:
            self.codecs = self.codec.layer_codecs(
                layer_shapes(
                    shape.num_layers,
                    shape.layer_kv_heads,
                    shape.layer_head_dims,
                    shape.layer_value_dims,
                    self.page_size,
                    dtype,
                    device,
                )
            )
        disk_tier = self._disk_tier(dtype)
        config = StoreConfig(
            shape.num_layers,
            shape.layer_kv_heads,
            shape.layer_head_dims,
            value_dim=shape.layer_value_dims,
            page_size=self.page_size,
            dtype=dtype,
            device=device,
            read_cache=self.read_cache,
            codecs=self.codecs,
            device_pages=self._device_pages(dtype),
            host_pages=self._host_pages(dtype),
            key_summaries=self.tiering is not None and self.tiering.key_summaries,
            disk_pages=disk_tier.get("disk_pages", 0),
            placement=self.tiering,
        )
        prefetch = self.tiering is not None and self.tiering.prefetches()
        return PagedStore(config, spill=disk_tier.get("spill"), prefetcher=PagePrefetcher(config.device) if prefetch else None)

    def _page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes a page the tiers move takes: the largest layer's keys and values in ``dtype``, or,
        with a codec whose fields are known (every layer's ready), the largest layer's encoded page."""
        element = torch.empty((), dtype=dtype).element_size()
        raw = self.page_size * max(k + v for k, v in zip(self.shape.layer_head_dims, self.shape.layer_value_dims)) * element
        codecs = self._ready_codecs()
        return raw if codecs is None else max(codec.page_bytes() for codec in codecs)

    def _ready_codecs(self) -> list[PageCodec] | None:
        """The store's per-layer codecs when every layer has one that is ready (its fields known), else None."""
        if self.codecs is None or not all(codec is not None and codec.ready for codec in self.codecs):
            return None
        return self.codecs

    def _record_layout(self, dtype: torch.dtype) -> Layout:
        """The layout of a spilled page's record: keys and values in ``dtype``, or, with ready
        codecs, the largest layer's packed fields as bytes (:class:`~kvlib.storage.pools.formats.field_rows.FieldRows`)."""
        codecs = self._ready_codecs()
        if codecs is None:
            shape = self.shape
            return Layout(bytes(16), 1, 1, self.page_size, max(shape.layer_head_dims), max(shape.layer_value_dims), dtype)
        rows = max((FieldRows.of(codec.fields) for codec in codecs), key=lambda rows: rows.page_bytes)
        return Layout(bytes(16), 1, 1, 1, rows.key_bytes, rows.value_bytes, torch.uint8)

    def _device_pages(self, dtype: torch.dtype) -> int | None:
        """Pages per layer the tiering policy keeps on the device (None: no tiering)."""
        return None if self.tiering is None else self.tiering.device_pages(self.shape.num_layers, self._page_bytes(dtype))

    def _host_pages(self, dtype: torch.dtype) -> int | None:
        """Pages per layer the tiering policy allows on the host (None: unbounded)."""
        return None if self.tiering is None else self.tiering.host_pages(self.shape.num_layers, self._page_bytes(dtype))

    def _disk_tier(self, dtype: torch.dtype) -> dict:
        """The store's ``spill`` and ``disk_pages`` when the tiering policy names a disk (the
        spill store opened once per cache)."""
        if self.tiering is None or not self.tiering.disk_directory():
            return {}
        shape = self.shape
        layout = self._record_layout(dtype)
        disk_pages = self.tiering.disk_pages(shape.num_layers, record_size(layout))
        if self.spill is None:
            self.spill = SpillStore(self._spill_tier, capacity_bytes=disk_pages * shape.num_layers * record_size(layout))
        return {"spill": self.spill, "disk_pages": disk_pages}


def _spill_tier(tiering: Tiering | None) -> DiskTier | None:
    """The disk tier of the directory ``tiering`` spills to (None: it spills nowhere), opened
    now: a directory that cannot hold one is refused before any model work, as a ``ValueError``."""
    if tiering is None or not tiering.disk_directory():
        return None
    try:
        return open_disk_tier(tiering.disk_directory(), capacity_bytes=1)
    except DiskTierUnavailable as error:
        raise ValueError(
            f"{tiering.spec()}: {error}; spilled pages need a disk tier: name a writable directory, "
            "or drop disk= to keep pages in host memory only"
        ) from None
