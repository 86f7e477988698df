"""ChunkKV: keep whole chunks of consecutive tokens, scored by an inner policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, EvictionWrapper, LayerView, WithInner
from kvlib.registry import register


@dataclass
class _Choice:
    """The chunk scores one layer of a call chose, kept for the later layers of its reuse group.

    ``layer``: the layer that chose; ``newest``: int64 ``[batch, kv_heads]``, each head's newest
    position in that call (what identifies the call); ``table``: float32 ``[batch, kv_heads,
    chunks]``, each chunk's score (``-inf`` for a chunk with no finite-scored token there).
    """

    layer: int
    newest: torch.Tensor
    table: torch.Tensor


@register("chunkkv")
@dataclass
class ChunkKV(EvictionWrapper):
    """ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
    Long-Context LLM Inference"): the unit of eviction is a chunk of ``chunk_size`` consecutive
    tokens, so kept text stays whole phrases instead of scattered tokens.

    Each token's ``inner`` score is replaced by its chunk's score: the sum of the finite inner
    scores of the chunk's valid tokens in the same KV head (the official code sums the window
    attention per chunk and head). Chunks are fixed by position (``position // chunk_size``,
    counted from the row's first real token), so they do not move as tokens are evicted and are
    the same in every layer and head. Non-finite inner scores pass through token by token: an
    inner's must-keep tokens (SnapKV's window, ``+inf``) stay kept on their own, as the official
    code keeps the window apart from the chunks.

    Invariants: every finite-scored token of a chunk gets the same score, and the engine's
    selection is stable in slot order, so whole chunks are kept, equal chunk scores going to the
    earlier chunk; only the last chunk a budget reaches is cut (its earliest tokens kept) when the
    budget is not a multiple of ``chunk_size`` (the official code keeps ``budget // chunk_size``
    whole chunks and leaves the rest of the budget unused).

    Layer-wise index reuse (``reuse_layers > 1``): layers form groups of ``reuse_layers``
    consecutive layers (``layer // reuse_layers``); the first layer of a group that compacts in a
    call chooses the chunk scores, and the group's later layers in the same call reuse them,
    mapped by position, so they keep the same chunks. A call is recognised by its batch shape and
    each head's newest position. A token whose chunk held no finite-scored token in the choosing
    layer scores ``-inf`` (dropped first). Reuse reproduces the paper's selection; it saves no
    compute here, since the engine computes the inner's inputs for every layer and the inner still
    runs on reused layers to mark its non-finite tokens.

    Args:
        inner: the token scorer (an eviction policy or its spec string, e.g.
            ``"snapkv(window=16)"``). Default SnapKV, as in the paper and kvpress; the official
            code sums unpooled window attention, which ``"snapkv(kernel=1)"`` reproduces.
        chunk_size: tokens per chunk. The paper finds 10 robust across tasks and models.
        reuse_layers: layers per index-reuse group; 1 (the default, as in the paper's main
            results) chooses in every layer.
    """

    inner: Eviction = field(default_factory=SnapKV)
    chunk_size: int = 10
    reuse_layers: int = 1
    _choice: Any = field(default=None, init=False, repr=False, compare=False)
    needs = WithInner(frozenset(), lambda own, inner: inner)
    reads_kv = WithInner(True, lambda own, inner: inner)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (tokens), got {self.chunk_size}")
        if self.reuse_layers < 1:
            raise ValueError(f"reuse_layers must be >= 1 (layers), got {self.reuse_layers}")

    def score(self, view: LayerView) -> torch.Tensor:
        """The chunk score of each finite-scored token; the inner's non-finite scores; invalid ``-inf``."""
        inner = self.inner.score(view).float()
        chunk = torch.where(view.valid, view.positions, 0) // self.chunk_size
        newest = view.positions.amax(dim=-1)
        choice = self._reusable(view.layer_idx, newest)
        if choice is None:
            choice = _Choice(view.layer_idx, newest, self._chunk_table(view, inner, chunk))
            if self.reuse_layers > 1:
                self._choice = choice
        table = choice.table.to(inner.device)
        inside = chunk < table.shape[-1]
        chunk_scores = torch.where(inside, table.gather(-1, chunk.clamp(max=table.shape[-1] - 1)), -torch.inf)
        scores = torch.where(inner.isfinite(), chunk_scores, inner)
        return torch.where(view.valid, scores, -torch.inf)

    def _reusable(self, layer: int, newest: torch.Tensor) -> _Choice | None:
        """The choice an earlier layer of this layer's group made in this call, if any."""
        choice = self._choice
        if choice is None or self.reuse_layers == 1:
            return None
        same_group = choice.layer // self.reuse_layers == layer // self.reuse_layers and choice.layer < layer
        same_call = choice.newest.shape == newest.shape and torch.equal(choice.newest.to(newest.device), newest)
        return choice if same_group and same_call else None

    @staticmethod
    def _chunk_table(view: LayerView, inner: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """Float32 ``[batch, kv_heads, chunks]``: each chunk's sum of finite inner scores (``-inf`` if none)."""
        counted = view.valid & inner.isfinite()
        shape = (*chunk.shape[:-1], int(chunk.max()) + 1 if chunk.numel() else 1)
        table = inner.new_zeros(shape).scatter_add_(-1, chunk, torch.where(counted, inner, 0.0))
        members = inner.new_zeros(shape).scatter_add_(-1, chunk, counted.float())
        return torch.where(members > 0, table, -torch.inf)
