"""Builds the page pools of a paged store from its :class:`~kvlib.storage.store_config.StoreConfig`:
one pool per layer, of the kind the config asks for that layer."""

from __future__ import annotations

import torch

from kvlib.devices import check_fits
from kvlib.storage.coded_pool import CodedPagePool
from kvlib.storage.page_pool import PagePool
from kvlib.storage.partnered_pool import PartneredPagePool
from kvlib.storage.spill_store import SpillStore
from kvlib.storage.store_config import StoreConfig
from kvlib.storage.tiered_coded_pool import SpillLayer, TieredCodedPagePool
from kvlib.storage.tiered_pool import TieredPagePool


def build_pools(config: StoreConfig, *, spill: SpillStore | None = None) -> list[PagePool]:
    """One pool per layer of ``config``: with ``device_pages``, a
    :class:`~kvlib.storage.tiered_pool.TieredPagePool` (no codec) or a
    :class:`~kvlib.storage.tiered_coded_pool.TieredCodedPagePool` (a codec), spilling to a layer
    of ``spill`` if given; otherwise a :class:`~kvlib.storage.partnered_pool.PartneredPagePool`
    for a codec that leans on an earlier layer, a :class:`~kvlib.storage.coded_pool.CodedPagePool`
    for any other codec, else a :class:`~kvlib.storage.page_pool.PagePool`.

    ``ValueError`` before anything is allocated when the arenas would not fit in the memory the
    device has available, when ``spill`` is given without a host budget, or when a codec leans on
    a layer that is not an earlier coded one.
    """
    check_fits(
        f"a store of {config.num_layers} layers with pages_per_layer={config.pages_per_layer} of page_size={config.page_size} tokens",
        config.initial_bytes(),
        config.device,
    )
    if spill is not None and (config.device_pages is None or config.host_pages is None):
        raise ValueError("a spill (disk tier) goes behind the host tier: give device_pages and host_pages too")
    pools: list[PagePool] = []
    tiered = config.device_pages is not None
    for layer, (head_dim, value_dim) in enumerate(zip(config.layer_key_dims, config.layer_value_dims)):
        shape = {
            "page_size": config.page_size,
            "head_dim": head_dim,
            "value_dim": value_dim,
            "dtype": config.dtype,
            "device": config.device,
        }
        arena = {"capacity": config.pages_per_layer, "fixed": config.fixed_capacity}
        codec = config.layer_codec(layer)
        partner = None if codec is None else getattr(codec, "partner_layer", None)
        tiers = {
            "device_pages": config.device_pages,
            "host_pages": config.host_pages,
            "key_summaries": config.key_summaries,
            "disk_pages": config.disk_pages,
            "placement": config.placement,
        }
        if codec is None and tiered:
            layer_spill = None if spill is None else spill.layer(layer, config.page_size, head_dim, value_dim, config.dtype)
            pool: PagePool = TieredPagePool(**shape, **arena, **tiers, spill=layer_spill)
        elif codec is None:
            pool = PagePool(**shape, **arena, key_summaries=config.key_summaries)
        elif partner is not None:
            if not 0 <= partner < layer or config.layer_codec(partner) is None:
                raise ValueError(f"layer {layer}'s codec leans on layer {partner}, which must be an earlier coded layer")
            pool = PartneredPagePool(**shape, **arena, codec=codec, partner_pool=pools[partner])
        elif tiered:
            pool = TieredCodedPagePool(**shape, **arena, codec=codec, **tiers, spill_layer=_coded_spill(spill, layer, config.page_size))
        else:
            pool = CodedPagePool(**shape, **arena, codec=codec, key_summaries=config.key_summaries)
        pools.append(pool)
    return pools


def _coded_spill(spill: SpillStore | None, layer: int, page_size: int) -> SpillLayer | None:
    """How a tiered coded pool of ``layer`` makes its spill: records of one byte page each,
    its two packed rows of fields (None without a ``spill``)."""
    if spill is None:
        return None
    return lambda rows: spill.layer(layer, 1, rows.key_bytes, rows.value_bytes, torch.uint8)
