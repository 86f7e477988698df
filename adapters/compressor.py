"""Eviction after a layer's attention: which stored tokens each head keeps within its budget.

The budget is a token count per (layer, head) or a fraction of the prompt:

- ``int``: a cap held at all times. After a layer call (prefill or a decode step) in which a
  head holds more than ``budget + slack`` real tokens, it keeps its ``budget`` best-scored ones
  (``slack`` 0: every step; larger: compaction every ``slack + 1`` decode steps, at the cost of
  up to ``slack`` extra tokens).
- ``float`` in (0, 1]: the prompt is compressed once, in the call that fills an empty cache, to
  ``ceil(budget * real prompt tokens)`` per head; later tokens are all kept.

Padding tokens (left padding of a batch) are never kept once a strategy runs, so a padded row
holds what it would hold alone. Strategies get exactly the extras they declare in ``needs``;
for one that needs nothing, nothing beyond the scores is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.adapters.layer_step import LayerStep
from kvlib.adapters.masks import allowed, physical_mask
from kvlib.selection import select_keep
from kvlib.strategy import Eviction, LayerView


@dataclass
class AttentionInputs:
    """What the attention function saw, for strategies that need it (references, no copies).

    query ``[batch, query_heads, query_length, head_dim]``; mask: the mask attention ran with
    (model mask if the layer was untouched, else the physical one); weights: attention weights
    if the inner attention returned them; scaling: softmax scale; hidden_states: the attention
    module's input, when a strategy needs it; real_new: bool ``[batch, query_length]`` or None.
    """

    query: torch.Tensor
    mask: torch.Tensor | None
    weights: torch.Tensor | None
    scaling: float | None
    real_new: torch.Tensor | None
    hidden_states: torch.Tensor | None = None


@dataclass
class Compressor:
    """Applies ``strategy`` within ``budget`` (see the module docstring for the budget forms)."""

    strategy: Eviction
    budget: int | float
    num_layers: int
    slack: int = 0

    def keep(self, step: LayerStep, inputs: AttentionInputs, real_offsets: torch.Tensor) -> torch.Tensor | None:
        """Slot indices ``[batch, heads, k]`` (-1 padded) each head keeps, or None if all stay.

        ``real_offsets [batch]`` (on the store's device) is each row's count of padding tokens before its first real
        one: subtracted from stored positions, it gives the positions strategies see.
        """
        read = step.read
        candidates = read.valid & ~_padding_slots(step, inputs.real_new)
        counts = candidates.sum(-1).cpu()
        stored = read.valid.sum(-1).cpu()
        caps = self._caps(step, counts)
        within = caps is None or bool((counts <= caps + self.slack).all())
        if within and bool((counts == stored).all()):
            return None
        if caps is None:
            caps = counts
        offsets = real_offsets.to(read.positions.device).view(-1, 1, 1)
        view = LayerView(
            layer_idx=step.layer_idx,
            num_layers=self.num_layers,
            keys=read.keys,
            values=read.values,
            positions=torch.where(candidates, read.positions - offsets, -1),
            valid=candidates,
        )
        self._fill_needs(view, step, inputs)
        scores = self.strategy.score(view)
        if not isinstance(scores, torch.Tensor) or scores.shape != candidates.shape:
            raise ValueError(
                f"{type(self.strategy).__name__}.score must return a tensor of shape {list(candidates.shape)}, got"
                f" {getattr(scores, 'shape', type(scores).__name__)}"
            )
        return select_keep(scores, candidates, caps)

    def _caps(self, step: LayerStep, counts: torch.Tensor) -> torch.Tensor | None:
        if isinstance(self.budget, int):
            return torch.full_like(counts, self.budget)
        if step.query_offset != 0:
            return None
        prompt = counts.max(dim=-1, keepdim=True).values.to(torch.float64)
        return (prompt * self.budget).ceil().clamp(min=1).to(torch.int64).expand_as(counts)

    def _fill_needs(self, view: LayerView, step: LayerStep, inputs: AttentionInputs) -> None:
        needs = self.strategy.needs
        if "queries" in needs or "window_queries" in needs:
            view.queries = inputs.query
            view.window_queries = inputs.query
        if "hidden_states" in needs:
            view.hidden_states = inputs.hidden_states
        if "attention" in needs:
            view.attention = inputs.weights if inputs.weights is not None else _attention_weights(step, inputs)


def _padding_slots(step: LayerStep, real_new: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[batch, heads, slots]``: stored slots holding this call's padding tokens."""
    read = step.read
    if real_new is None:
        return torch.zeros_like(read.valid)
    new_index = read.positions - step.query_offset
    is_new = read.valid & (new_index >= 0)
    batch = torch.arange(read.valid.shape[0], device=read.valid.device).view(-1, 1, 1)
    real = real_new[batch, new_index.clamp(0, step.query_length - 1)]
    return is_new & ~real


def _attention_weights(step: LayerStep, inputs: AttentionInputs) -> torch.Tensor:
    """Softmax attention weights ``[batch, query_heads, query_length, slots]`` of this call.

    Only computed for strategies that need them when the inner attention (SDPA) returned none.
    """
    query, keys = inputs.query, step.read.keys
    groups = query.shape[1] // keys.shape[1]
    scale = inputs.scaling if inputs.scaling is not None else query.shape[-1] ** -0.5
    logits = torch.matmul(query, keys.repeat_interleave(groups, dim=1).transpose(-1, -2)).float() * scale
    mask = inputs.mask
    visible = physical_mask(None, step, query.shape[1], None) if mask is None else allowed(mask)
    logits = logits.masked_fill(~visible, -torch.inf)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).to(query.dtype)

