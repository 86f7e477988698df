"""What a :class:`~kvlib.storage.store.paged_store.PagedStore` holds and where: shapes, page size, capacity,
codecs and tiers, validated once (:class:`StoreConfig`), and what its arenas take up front."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlib.codec import PageCodec
from kvlib.devices import resolve_device
from kvlib.errors import quoted
from kvlib.limits import check_page_size
from kvlib.placement import Placement
from kvlib.storage.pools.page_pool import DEFAULT_PAGES_PER_LAYER

FIRST_ROWS = 16
"""Key and value rows a coded pool's raw arena and a tiered pool's host arena start with, and
the fewest a tiered pool's device arena may (see :func:`initial_arena_bytes`)."""


@dataclass(frozen=True)
class StoreConfig:
    """The shape and placement of a paged store's pages (what the pool factory builds from).

    Args:
        num_layers: attention layers stored.
        num_kv_heads: KV heads per layer (an int, or one per layer).
        head_dim: key channels per head (an int, or one per layer).
        value_dim: value channels per head; defaults to ``head_dim``.
        page_size: tokens per page (at most :data:`~kvlib.limits.MAX_PAGE_SIZE`).
        dtype: compute dtype of keys and values.
        device: where the page arenas live (None: the default device; held resolved).
        pages_per_layer: initial arena capacity in pages (the capacity, if ``fixed_capacity``).
        fixed_capacity: never grow the arenas; appends that do not fit raise
            :class:`~kvlib.errors.PoolExhaustedError` and change nothing.
        read_cache: keep a dense per-layer mirror of the last batch read so decode steps copy
            only new tokens (see :mod:`kvlib.storage.layers.read_cache`); its bytes are reported separately.
        codecs: one :class:`~kvlib.codec.PageCodec` per layer to encode sealed pages with (None
            for a layer kept in ``dtype``), or None to keep every page in ``dtype``. A codec with a
            ``partner_layer`` (a cross-layer codec's deeper layer) leans on that earlier layer.
        device_pages: at most this many pages of each layer stay on ``device``; the others move
            to host memory (a tiered pool). None keeps every page on the device. With a codec it
            bounds the sealed pages, which move encoded; open pages stay on the device. Not
            combined with a cross-layer codec (``partner_layer``).
        host_pages: at most this many pages of each layer on the host (None: unbounded).
        key_summaries: keep each page's channel-wise key min and max on ``device`` (for
            ``quest``), from the keys as written (before a codec encodes them). Not combined with
            a cross-layer codec.
        disk_pages: with a spill (disk tier) given to the store, at most this many pages of each
            layer on disk.
        placement: with ``device_pages``, the rule ordering the pages that leave the device and
            the host (a tiering policy; see :mod:`kvlib.placement`). None: lowest placement
            score first, then least recently written.

    Invalid values raise ``ValueError`` when the config is made.
    """

    num_layers: int
    num_kv_heads: int | Sequence[int]
    head_dim: int | Sequence[int]
    value_dim: int | Sequence[int] | None = None
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None
    pages_per_layer: int = DEFAULT_PAGES_PER_LAYER
    fixed_capacity: bool = False
    read_cache: bool = True
    codecs: Sequence[PageCodec | None] | None = None
    device_pages: int | None = None
    host_pages: int | None = None
    key_summaries: bool = False
    disk_pages: int = 0
    placement: Placement | None = None

    def __post_init__(self) -> None:
        num_layers, fixed = self.num_layers, self.fixed_capacity
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        check_page_size(self.page_size)
        for name, value in (("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim), ("value_dim", self.value_dim)):
            if value is not None:
                _per_layer(name, value, num_layers)
        pages = self.pages_per_layer
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < int(fixed):
            raise ValueError(f"pages_per_layer must be an int >= {int(fixed)}, got {quoted(pages)}")
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.codecs is not None and len(self.codecs) != num_layers:
            raise ValueError(f"codecs must name one codec per layer ({num_layers}), got {len(self.codecs)}")
        partnered = [layer for layer, codec in enumerate(self.codecs or ()) if getattr(codec, "partner_layer", None) is not None]
        if partnered and (self.device_pages is not None or self.key_summaries):
            raise ValueError(
                f"layers {partnered} use a cross-layer codec (minicache), whose sealed pages decode with their partner layer's"
                " fields read in place by page id: it does not combine with device_pages (tiering) or key_summaries (quest)"
            )

    @property
    def layer_heads(self) -> list[int]:
        """KV heads of each layer."""
        return _per_layer("num_kv_heads", self.num_kv_heads, self.num_layers)

    @property
    def layer_key_dims(self) -> list[int]:
        """Key channels per head of each layer."""
        return _per_layer("head_dim", self.head_dim, self.num_layers)

    @property
    def layer_value_dims(self) -> list[int]:
        """Value channels per head of each layer."""
        if self.value_dim is None:
            return self.layer_key_dims
        return _per_layer("value_dim", self.value_dim, self.num_layers)

    def layer_codec(self, layer: int) -> PageCodec | None:
        """The codec sealing ``layer``'s pages (None: kept in ``dtype``)."""
        return None if self.codecs is None else self.codecs[layer]

    def initial_bytes(self) -> int:
        """Bytes the store's arenas take when it is built (:func:`initial_arena_bytes`)."""
        return initial_arena_bytes(
            self.layer_key_dims,
            self.layer_value_dims,
            self.page_size,
            self.dtype,
            self.pages_per_layer,
            coded=self.codecs is not None,
            tiered=self.device_pages is not None,
        )


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
