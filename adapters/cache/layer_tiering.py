"""A tiering policy's work on one cache layer's stored tokens, after the layer's attention.

:func:`arrange` puts the layer's tokens in the policy's slot order (``shadowkv``, ``clusterkv``:
tokens that are read together share pages); :func:`rank_pages` re-ranks the layer's pages for
the device tier by the policy's scores. Both hand the policy :func:`tiering_view`: the
layer's real tokens, positions counted from each row's first real token (left padding invalid),
as if each row had been run alone.
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.shared_state import SharedState
from kvlib.policy import LayerView
from kvlib.storage.layers.read_cache import LayerRead


def arrange(cache: SharedState, layer_idx: int, read: LayerRead) -> torch.Tensor:
    """Put the stored tokens ``read`` of ``layer_idx`` in the tiering policy's slot order (its
    view holds the real tokens; padding slots follow them, in slot order); per-slot compressor
    state follows. Returns the store's layout (slots no longer equal positions)."""
    order = cache.tiering.arrangement(tiering_view(cache, layer_idx, read)).cpu()
    stored = read.valid.cpu()
    slots = stored.shape[-1]
    named = torch.zeros(*stored.shape[:2], slots + 1, dtype=torch.bool).scatter_(-1, torch.where(order >= 0, order, slots), True)
    named = named[..., :slots]
    slot = torch.arange(slots).expand_as(stored)
    order = torch.cat([order, torch.where(stored & ~named, slot, -1)], dim=-1)
    order = order.gather(-1, torch.sort((order < 0).to(torch.int8), dim=-1, stable=True).indices)
    layout = cache.store.arrange(layer_idx, cache.rows, order[..., :slots])
    if cache.compressor is not None:
        cache.compressor.compacted(layer_idx, layout)
    return layout


def rank_pages(cache: SharedState, layer_idx: int, read: LayerRead) -> None:
    """Re-rank the pages of ``layer_idx`` for the device tier by the tiering policy's scores of
    its stored tokens ``read`` (the layer as it now stands; padding never counts)."""
    cache.store.rank_pages(layer_idx, cache.rows, cache.tiering.ranking_scores(tiering_view(cache, layer_idx, read)))


def tiering_view(cache: SharedState, layer_idx: int, read: LayerRead) -> LayerView:
    """The stored tokens ``read`` of ``layer_idx`` as the tiering policy sees them: positions
    from each row's first real token, padding invalid."""
    padding = cache.padding.to(read.positions.device).view(-1, 1, 1)
    real = read.valid & (read.positions >= padding)
    return LayerView(
        layer_idx,
        cache.shape.num_layers,
        read.keys,
        read.values,
        torch.where(real, read.positions - padding, -1),
        real,
        page_size=cache.store.page_size,
    )
