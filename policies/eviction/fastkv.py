"""FastKV: per-head SnapKV selection in early layers, one propagated token set from a middle layer on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import LayerView
from kvlib.registry import register

NOTE = "fastkv"
"""The ``call_notes`` key of the TSP layer's choice: ``(layer, table)``, ``table`` float32
``[batch, positions]`` the shared score of each position (``-inf`` where no head held it)."""


@register("fastkv")
@dataclass
class FastKV(SnapKV):
    """FastKV (Jo et al., 2025, "FastKV: KV Cache Compression for Fast Long-Context Processing
    with Token-Selective Propagation").

    Layers before ``tsp_layer`` keep their budget per head by SnapKV's pooled window attention
    (the paper's early layers run on the full context and compress their KV like SnapKV). At the
    TSP layer one token set is chosen for all heads: each token's score is the sum over the
    layer's KV heads of its pooled window attention (the paper aggregates the TSP layer's
    attention over heads, since a token's hidden state propagates whole). That layer and every
    later one keep exactly that set: a later layer scores each token by the TSP layer's score of
    its position, so with equal caps per head every head of every layer from ``tsp_layer`` on
    holds the same positions. The observation window's tokens score ``+inf`` everywhere (kept).

    The saving the paper is named for, running the later layers' prefill on the propagated
    tokens' hidden states only, is a change to the model's forward pass and lies outside a KV
    cache: here every layer still computes the full prompt, and only the KV kept follows FastKV.

    Cross-layer state: the TSP layer's choice lives in the engine's ``call_notes`` (one model
    call's notes, cleared when the next call begins), keyed by position, not in this instance:
    one FastKV object may serve several caches or Engine requests. A later layer that compacts
    in a call in which the TSP layer chose nothing (it held no more than its cap) chooses the
    shared set by its own attention, as the TSP layer would have.

    Args:
        window, kernel, pooling: as in :class:`SnapKV`; the official code observes the last 8
            queries and pools with a 7-wide average.
        tsp_layer: the token-selective propagation layer (``0 <= tsp_layer < layers``), or -1
            (the default): ``(layers - 1) // 2``, the middle, as the paper's layer 15 of
            LLaMA-3.1-8B's 32.
    """

    window: int = 8
    kernel: int = 7
    tsp_layer: int = -1
    needs: ClassVar[frozenset[str]] = frozenset({"attention", "call_notes"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tsp_layer < -1:
            raise ValueError(f"tsp_layer must be a layer index >= 0 or -1 (the middle layer), got {self.tsp_layer}")

    def propagation_layer(self, num_layers: int) -> int:
        """The TSP layer of a model of ``num_layers`` layers; ``ValueError`` if it has no such layer."""
        layer = (num_layers - 1) // 2 if self.tsp_layer == -1 else self.tsp_layer
        if layer >= num_layers:
            raise ValueError(f"tsp_layer must be below the model's {num_layers} layers, got {self.tsp_layer}")
        return layer

    def score(self, view: LayerView) -> torch.Tensor:
        """SnapKV per head below the TSP layer; from it on, the TSP layer's shared score by position."""
        if view.layer_idx < self.propagation_layer(view.num_layers):
            return super().score(view)
        notes = view.call_notes if view.call_notes is not None else {}
        choice = notes.get(NOTE)
        if choice is None:
            choice = notes[NOTE] = (view.layer_idx, shared_table(view, super().score(view)))
        table = choice[1].to(view.positions.device)
        position = view.positions.clamp(min=0)
        inside = position < table.shape[-1]
        gathered = table.gather(-1, position.clamp(max=table.shape[-1] - 1).flatten(1)).view_as(view.valid)
        return torch.where(view.valid & inside, gathered, -torch.inf)


def shared_table(view: LayerView, per_head: torch.Tensor) -> torch.Tensor:
    """Float32 ``[batch, newest position + 1]``: each position's per-head scores summed over the
    heads holding it (``+inf`` if any head scores it so, ``-inf`` if no head holds it)."""
    batch = per_head.shape[0]
    width = int(view.positions.max()) + 1 if view.positions.numel() else 1
    position = view.positions.clamp(min=0).flatten(1)
    finite = (view.valid & per_head.isfinite()).flatten(1)
    table = per_head.new_zeros(batch, width).scatter_add_(-1, position, torch.where(finite, per_head.flatten(1), 0.0))
    held = per_head.new_zeros(batch, width).scatter_add_(-1, position, view.valid.flatten(1).float())
    kept = per_head.new_zeros(batch, width).scatter_add_(-1, position, (view.valid & (per_head == torch.inf)).flatten(1).float())
    table = torch.where(kept > 0, torch.inf, table)
    return torch.where(held > 0, table, -torch.inf)
