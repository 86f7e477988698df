"""Builds the page pools of a paged store from its :class:`~kvlib.storage.store.store_config.StoreConfig`:
one :class:`~kvlib.storage.pools.page_pool.PagePool` per layer, given the format the config asks for
that layer (the one place a pool's parts are chosen)."""

from __future__ import annotations

import torch

from kvlib.devices import check_fits
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.formats.page_format import ArenaPages, PageFormat
from kvlib.storage.pools.formats.partnered_format import PartneredPages
from kvlib.storage.pools.formats.tiered_coded_format import SpillLayer, TieredCodedPages
from kvlib.storage.pools.formats.tiered_format import TierBudgets, TieredPages
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.store.store_config import StoreConfig
from kvlib.storage.tiers.spill_store import SpillStore


def build_pools(config: StoreConfig, *, spill: SpillStore | None = None) -> list[PagePool]:
    """One pool per layer of ``config``, of the format :func:`layer_format` chooses.

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
    for layer, (head_dim, value_dim) in enumerate(zip(config.layer_key_dims, config.layer_value_dims)):
        pool = PagePool(
            page_size=config.page_size,
            head_dim=head_dim,
            value_dim=value_dim,
            dtype=config.dtype,
            device=config.device,
            capacity=config.pages_per_layer,
            fixed=config.fixed_capacity,
            key_summaries=config.key_summaries,
            format=layer_format(config, layer, pools, spill),
        )
        pools.append(pool)
    return pools


def layer_format(config: StoreConfig, layer: int, earlier: list[PagePool], spill: SpillStore | None) -> PageFormat:
    """The format of ``layer``'s pool: with ``device_pages``, tiers
    (:class:`~kvlib.storage.pools.formats.tiered_format.TieredPages`, or :class:`~kvlib.storage.pools.formats.tiered_coded_format.TieredCodedPages`
    with a codec), spilling to a layer of ``spill`` if given; otherwise
    :class:`~kvlib.storage.pools.formats.partnered_format.PartneredPages` for a codec that leans on an earlier
    layer (whose pool is in ``earlier``), :class:`~kvlib.storage.pools.formats.coded_format.CodedPages` for any
    other codec, else :class:`~kvlib.storage.pools.formats.page_format.ArenaPages`."""
    codec = config.layer_codec(layer)
    budgets = (
        None if config.device_pages is None else TierBudgets(config.device_pages, config.host_pages, config.disk_pages, config.placement)
    )
    if codec is None:
        if budgets is None:
            return ArenaPages()
        key_dim, value_dim = config.layer_key_dims[layer], config.layer_value_dims[layer]
        layer_spill = None if spill is None else spill.layer(layer, config.page_size, key_dim, value_dim, config.dtype)
        return TieredPages(budgets, layer_spill)
    partner = getattr(codec, "partner_layer", None)
    if partner is not None:
        if not 0 <= partner < layer or config.layer_codec(partner) is None:
            raise ValueError(f"layer {layer}'s codec leans on layer {partner}, which must be an earlier coded layer")
        return PartneredPages(codec, earlier[partner])
    if budgets is not None:
        return TieredCodedPages(codec, budgets, _coded_spill(spill, layer))
    return CodedPages(codec)


def _coded_spill(spill: SpillStore | None, layer: int) -> SpillLayer | None:
    """How a tiered coded format of ``layer`` makes its spill: records of one byte page each,
    its two packed rows of fields (None without a ``spill``)."""
    if spill is None:
        return None
    return lambda rows: spill.layer(layer, 1, rows.key_bytes, rows.value_bytes, torch.uint8)
