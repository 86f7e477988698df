"""WindowKV: keep whole windows of consecutive tokens, chosen once per group of layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.policies.eviction.snapkv import SnapKV
from kvlib.policy import Eviction, LayerView
from kvlib.registry import register

NOTE = "windowkv"
"""The ``call_notes`` key of the groups' choices: a dict from layer group to float32 ``[batch,
kv_heads, windows]``, each review window's score in the group's choosing layer (``-inf`` for a
window that layer held no context token of)."""


@register("windowkv")
@dataclass
class WindowKV(Eviction):
    """WindowKV (Zuo et al., 2025, "WindowKV: Task-Adaptive Group-Wise KV Cache Window Selection
    for Efficient LLM Inference").

    The context is cut into review windows of ``review_window`` consecutive positions (fixed by
    ``position // review_window``, counted from the row's first real token, so they never move
    as tokens are evicted). The last ``window`` queries of a call (the observation window) score
    each review window per KV head by the attention they give its tokens: summed over the
    observed queries and the window's tokens, averaged over the query heads of the KV group.
    Every token of a window gets its window's score, so the engine's selection (stable in slot
    order) keeps whole windows, best first; only the last window a budget reaches is cut. The
    observation window's own tokens score ``+inf`` (kept), as in the paper and SnapKV. Windows are
    fixed, so a span that straddles a boundary (a 7-digit needle over two windows of 8) is kept
    whole only when both windows are: on SmolLM2's RULER needles at 1k tokens and 25% budget
    windowkv answered one digit short where SnapKV, whose pooling keeps a kept token's
    neighbours, answered in full (and the reverse on another case).

    Intra-group index sharing: layers form groups of ``group_layers`` consecutive layers
    (``layer // group_layers``); the first layer of a group that compacts in a call scores the
    windows and the group's later layers keep the same windows (mapped by position). The choice
    lives in the engine's per-call ``call_notes``, so nothing outlives the call or passes between
    caches. Sharing saves the paper's selection compute; here the engine still computes each
    layer's window attention (a cache cannot skip it), so it only reproduces the selection.

    Task adaptivity: the paper picks the review window size per task with a small classifier
    (smaller windows for information-localisation tasks such as retrieval, larger ones for
    aggregation tasks such as summarisation). kvlib has no such classifier: the size is the
    spec's choice (``windowkv(review_window=4)`` for retrieval-like prompts). The paper's budget
    split over layer groups is pyramid-like: name ``pyramid`` in the spec for that
    (``"windowkv+pyramid"``); the default is uniform.

    Args:
        window: observation window, in queries (the last ``window`` of a call).
        review_window: tokens per review window (>= 1).
        group_layers: layers per index-sharing group (>= 1; 1 chooses in every layer).
    """

    window: int = 8
    review_window: int = 8
    group_layers: int = 4
    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"attention", "call_notes"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (queries), got {self.window}")
        if self.review_window < 1:
            raise ValueError(f"review_window must be >= 1 (tokens), got {self.review_window}")
        if self.group_layers < 1:
            raise ValueError(f"group_layers must be >= 1 (layers), got {self.group_layers}")

    def observed_queries(self) -> int:
        return self.window

    def score(self, view: LayerView) -> torch.Tensor:
        """Each context token's review-window score; observation-window tokens ``+inf``; invalid ``-inf``."""
        attention = view.attention[:, :, -self.window :, :].float()
        in_window = SnapKV.window_tokens(view, attention.shape[2])
        windows = torch.where(view.valid, view.positions, 0) // self.review_window
        choices = view.call_notes.setdefault(NOTE, {}) if view.call_notes is not None else {}
        group = view.layer_idx // self.group_layers
        table = choices.get(group)
        if table is None or table.shape[:2] != windows.shape[:2]:
            table = choices[group] = self.window_table(view, attention, in_window, windows)
        table = table.to(windows.device)
        inside = windows < table.shape[-1]
        scores = torch.where(inside, table.gather(-1, windows.clamp(max=table.shape[-1] - 1)), -torch.inf)
        scores = torch.where(in_window, torch.inf, scores)
        return torch.where(view.valid, scores, -torch.inf)

    @staticmethod
    def window_table(view: LayerView, attention: torch.Tensor, in_window: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Float32 ``[batch, kv_heads, windows]``: each review window's observed attention, summed
        over its context tokens and the observed queries, averaged over each KV group's query heads
        (``-inf`` for a window holding no context token)."""
        batch, heads, slots = view.valid.shape
        votes = attention.sum(dim=2).view(batch, heads, -1, slots).mean(dim=2)
        context = view.valid & ~in_window
        width = int(windows.max()) + 1 if windows.numel() else 1
        table = votes.new_zeros(batch, heads, width).scatter_add_(-1, windows, torch.where(context, votes, 0.0))
        members = votes.new_zeros(batch, heads, width).scatter_add_(-1, windows, context.float())
        return torch.where(members > 0, table, -torch.inf)
