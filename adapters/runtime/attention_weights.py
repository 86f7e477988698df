"""Softmax attention weights over stored slots, for policies that need them.

SDPA returns no weights, so the evictor recomputes them for the queries a policy asks for,
a bounded block of queries at a time (never a full ``[query, slot]`` matrix of a long prompt
at once), grouped by KV head (no key copies for grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.masks import allowed

BLOCK_ELEMENTS = 1 << 24
"""Most weight elements (``batch * query_heads * queries * slots``) computed in one block."""


def attention_blocks(
    step: LayerStep,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    real_new: torch.Tensor | None,
    scaling: float | None,
    start: int,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(first query, weights)`` blocks covering queries ``start..query_length`` of ``step``.

    ``weights``: float32 ``[batch, query_heads, block, slots]``, each row the softmax of the
    query's scaled logits over the slots ``mask`` lets it see (``mask``: the mask attention ran
    with, whose last axis indexes the stored slots; None means causal in logical positions), 0
    elsewhere; rows of padding queries (``real_new`` False) are all 0.

    A step that attended straight over the pages (``step.paged``; ``mask`` then the model's mask
    over logical positions, as attention ran with it) gets its weights from the pages in one
    block (:meth:`~kvlib.kernels.pages.PagedLayer.weights`: its queries are few), in the slot
    order of ``step.read``; no key is copied.
    """
    if step.paged is not None:
        yield start, _weights_over_pages(step, query, mask, real_new, scaling, start)
        return
    keys = step.read.keys
    batch, kv_heads, slots, _ = keys.shape
    heads, total = query.shape[1], query.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    block = max(1, BLOCK_ELEMENTS // max(1, batch * heads * slots))
    for first in range(start, total, block):
        last = min(first + block, total)
        visible = _visible(step, mask, first, last, heads)
        if real_new is not None:
            visible = visible & real_new[:, first:last].view(batch, 1, -1, 1)
        seen = _slots_seen(visible)  # a causal prompt's early blocks see its first slots only
        rows = query[:, :, first:last].reshape(batch, kv_heads, groups * (last - first), -1)
        logits = torch.matmul(rows, keys[:, :, :seen].transpose(-1, -2)).float().mul_(scale)
        logits = logits.view(batch, heads, last - first, seen)
        weights = torch.softmax(logits.masked_fill_(~visible[..., :seen], -torch.inf), dim=-1).nan_to_num_(0.0)
        yield first, torch.nn.functional.pad(weights, (0, slots - seen))


def _slots_seen(visible: torch.Tensor) -> int:
    """One past the last slot any query of ``visible`` (bool ``[..., slots]``) sees (0: none)."""
    seen = visible.flatten(0, -2).any(0).nonzero()
    return int(seen[-1]) + 1 if seen.numel() else 0


def _visible(step: LayerStep, mask: torch.Tensor | None, first: int, last: int, heads: int) -> torch.Tensor:
    read = step.read
    batch, kv_heads, slots = read.valid.shape
    if mask is None:
        query_positions = step.query_offset + torch.arange(first, last, device=read.positions.device)
        visible = (read.positions.unsqueeze(2) <= query_positions.view(1, 1, -1, 1)) & read.valid.unsqueeze(2)
        return (
            visible.unsqueeze(2).expand(batch, kv_heads, heads // kv_heads, last - first, slots).reshape(batch, heads, last - first, slots)
        )
    return allowed(mask)[:, :, first:last, :slots].expand(batch, heads, last - first, slots)


def _weights_over_pages(
    step: LayerStep, query: torch.Tensor, mask: torch.Tensor | None, real_new: torch.Tensor | None, scaling: float | None, start: int
) -> torch.Tensor:
    """:func:`attention_blocks`' weights of queries ``start..`` for a step over the pages."""
    batch, total = query.shape[0], query.shape[2]
    if mask is None:  # causal in the logical positions
        visible, query_positions = None, step.query_offset + torch.arange(start, total)
    else:
        visible, query_positions = allowed(mask)[:, 0, start:].expand(batch, -1, -1), None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = step.paged.weights(query[:, :, start:], visible=visible, query_positions=query_positions, scale=scale)
    weights = weights[..., : step.read.valid.shape[-1]].to(step.read.valid.device)
    if real_new is not None:
        weights = weights * real_new[:, start:].to(weights.device).view(batch, 1, -1, 1)
    return weights
