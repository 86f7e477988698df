"""Position order of a layer's stored slots, for policies and selection that need it.

After a compaction that reused slots (:mod:`~kvlib.storage.layers.slot_reuse`), a head's slots are no longer in
position order. Eviction must keep the same tokens as if they were: the evictor selects among
slots sorted by position (ties in scores then break by position, as they always did), and hands a
policy that is not :attr:`~kvlib.policy.Eviction.order_free` a view permuted into that order.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.policy import LayerView


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


def scores_in_slot_order(scores: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Scores of position-ordered slots (``order[..., j]`` is the slot of the ``j``-th) back in slot order."""
    return torch.empty_like(scores).scatter_(-1, order.to(scores.device), scores)


def ascending(keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (slot indices, ``-1`` pads) sorted ascending per head with its ``-1`` padding last
    (the store's compacted order)."""
    past_end = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(keep < 0, past_end, keep), dim=-1).values
    return torch.where(ordered == past_end, -1, ordered)


def keep_all_but(positions: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch, heads, slots]``: each head's stored slots (``positions >= 0``, as
    :meth:`~kvlib.storage.store.paged_store.PagedStore.stored_positions` gives them) but the bool
    ``dropped`` ones, ascending, ``-1`` after them: the ``keep`` of a compaction that drops just
    those."""
    slots = positions.shape[-1]
    slot = torch.arange(slots, device=positions.device)
    keep = torch.sort(torch.where((positions >= 0) & ~dropped, slot, slots), dim=-1).values
    return torch.where(keep == slots, -1, keep)
