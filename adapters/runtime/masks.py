"""Masks over stored slots, from the model's masks over logical positions.

A `transformers` model builds its attention mask for a layer call over logical positions
``[0, tokens seen + new tokens)`` (``KVCache.get_mask_sizes`` reports that size and offset 0).
Once a layer has dropped tokens, slot ``s`` of a (row, head) no longer holds position ``s``;
these functions look each stored token's position up in the model's mask instead.
"""

from __future__ import annotations

import torch

from kvlib.adapters.runtime.layer_step import LayerStep


def allowed(mask: torch.Tensor) -> torch.Tensor:
    """A model mask (bool, or additive float with the dtype's minimum where masked) as bool."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min


def real_new_tokens(mask: torch.Tensor | None, step: LayerStep) -> torch.Tensor | None:
    """Which new tokens are real, bool ``[batch, query_length]``; None when all are.

    A padding token is masked even for itself, so the diagonal of the model's mask (query ``i``
    at logical position ``query_offset + i``) tells them apart under causal, sliding-window and
    chunked masks alike.
    """
    if mask is None:
        return None
    visible = allowed(mask)[:, 0]
    steps = torch.arange(step.query_length, device=mask.device)
    columns = (step.query_offset + steps).clamp(max=visible.shape[-1] - 1)
    return visible[:, steps, columns]


def physical_mask(mask: torch.Tensor | None, step: LayerStep, query_heads: int, float_dtype: torch.dtype | None) -> torch.Tensor:
    """The model's mask over logical positions, moved onto the stored slots of each KV head.

    Returns ``[batch, query_heads, query_length, slots]``: bool, or additive float in
    ``float_dtype`` when given (eager attention). Slot ``s`` of (row, head) is visible to query
    ``i`` iff it is valid and the model's mask allows query ``i`` to see the stored token's
    logical position. With no model mask (SDPA's causal shortcut), visibility is causal in the
    logical positions; with ``step.query_positions``, causal in those true positions.
    """
    read = step.read
    batch, heads, slots = read.valid.shape
    queries = step.query_length
    stored = read.valid.unsqueeze(2)
    if step.query_positions is not None:  # scattered queries: causal in their true positions
        visible = (read.positions.unsqueeze(2) <= step.query_positions.to(read.positions.device).view(1, 1, -1, 1)) & stored
    elif mask is None:
        query_positions = step.query_offset + torch.arange(queries, device=read.positions.device)
        visible = (read.positions.unsqueeze(2) <= query_positions.view(1, 1, -1, 1)) & stored
    else:
        logical = allowed(mask)
        columns = read.positions.clamp(0, logical.shape[-1] - 1).unsqueeze(2).expand(batch, heads, queries, slots)
        visible = logical.expand(batch, heads, queries, logical.shape[-1]).gather(-1, columns) & stored
    if query_heads != heads:
        visible = visible.repeat_interleave(query_heads // heads, dim=1)
    if float_dtype is None:
        return visible
    return torch.zeros(visible.shape, dtype=float_dtype, device=visible.device).masked_fill_(~visible, torch.finfo(float_dtype).min)


POSITION_BIAS = "position_bias"
"""The attention keyword argument of an additive bias over the keys' logical positions (Inkling 2's
relative position bias, ``[batch or 1, query_heads or 1, query_length, kv_length]``, built over the
columns ``KVCache.get_mask_sizes`` reports, as the mask is)."""


def move_position_bias(kwargs: dict, step: LayerStep, query_heads: int) -> None:
    """Move a :data:`POSITION_BIAS` in an attention call's ``kwargs`` onto the stored slots of
    ``step``'s read, in place: ``[batch, query_heads, query_length, slots]``, slot ``s`` taking
    the bias of the position it holds (an invalid slot's is left to the mask, which hides it)."""
    bias = kwargs.get(POSITION_BIAS)
    if not isinstance(bias, torch.Tensor) or bias.dim() != 4:
        return
    positions = step.read.positions
    batch, heads, slots = positions.shape
    columns = positions.clamp(0, bias.shape[-1] - 1).to(bias.device).repeat_interleave(query_heads // heads, dim=1)
    queries = bias.shape[2]
    columns = columns.unsqueeze(2).expand(batch, query_heads, queries, slots)
    kwargs[POSITION_BIAS] = bias.expand(batch, query_heads, queries, bias.shape[-1]).gather(-1, columns)
