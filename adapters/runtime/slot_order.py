"""Position order of a layer's stored slots, for strategies and selection that need it.

After a compaction that reused slots (:mod:`~kvlib.storage.slot_reuse`), a head's slots are no longer in
position order. Eviction must keep the same tokens as if they were: the compressor selects among
slots sorted by position (ties in scores then break by position, as they always did), and hands a
strategy that is not :attr:`~kvlib.strategy.Eviction.order_free` a view permuted into that order.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.strategy import LayerView


def position_order(positions: torch.Tensor, stored: torch.Tensor) -> torch.Tensor | None:
    """int64 ``[batch, heads, slots]``: the slot indices that sort each head's stored slots by
    position, unstored slots last (stable); None when every head already is in that order (the
    common case: no slot was reused), so nothing needs permuting."""
    key = torch.where(stored, positions, torch.iinfo(torch.int64).max)
    if bool((key[..., 1:] >= key[..., :-1]).all()):
        return None
    return torch.sort(key, dim=-1, stable=True).indices


def along_slots(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``[batch, heads, slots]`` or ``[batch, heads, slots, dim]``) with its slots
    taken in ``order`` (``[batch, heads, slots]``)."""
    if tensor.dim() == 3:
        return tensor.gather(2, order)
    return tensor.gather(2, order.unsqueeze(-1).expand(tensor.shape))


def weights_along_slots(weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Attention weights ``[batch, query_heads, queries, slots]`` (query heads grouped over the
    KV heads of ``order``) with their slots taken in ``order``."""
    grouped = order.repeat_interleave(weights.shape[1] // order.shape[1], dim=1)
    return weights.gather(3, grouped.unsqueeze(2).expand(weights.shape))


def ordered_view(view: LayerView, order: torch.Tensor) -> LayerView:
    """``view`` with every per-slot field taken in ``order`` (a copy of its keys and values)."""
    per_slot = ("keys", "values", "positions", "valid", "accumulated_attention")
    changes = {name: along_slots(getattr(view, name), order) for name in per_slot if getattr(view, name) is not None}
    if view.attention is not None:
        changes["attention"] = weights_along_slots(view.attention, order)
    if view.recent_attention is not None:
        changes["recent_attention"] = weights_along_slots(view.recent_attention, order)
    return dataclasses.replace(view, **changes)


def to_slots(keep: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Kept indices into the position-ordered slots (int64 ``[batch, heads, k]``, ``-1`` pads) as
    slot indices."""
    return torch.where(keep >= 0, order.to(keep.device).gather(-1, keep.clamp(min=0)), -1)
