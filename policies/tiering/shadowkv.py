"""ShadowKV: page summaries on the device, whole pages on the host, the chosen pages fetched per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.placement import PageStats, lowest_score_first
from kvlib.policy import LayerView, PageRetrieval
from kvlib.registry import register

OUTLIER_SCORE = 2.0
"""Placement score floor of an outlier page's tokens: above every window page (scores in ``[1, 2)``)."""


def landmark_spread(key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """How badly a page's landmark stands for its keys, float32 ``[...]`` from ``[..., head_dim]``
    channel-wise key minima and maxima: ``|max - min| / (|(max + min) / 2| + 1e-6)`` (L2 norms),
    the width of the box the page's keys lie in over the norm of its centre (the landmark). Pages
    whose keys point in different directions score high: ShadowKV's outlier chunks."""
    low, high = key_min.float(), key_max.float()
    return (high - low).norm(dim=-1) / ((high + low).mul(0.5).norm(dim=-1) + 1e-6)


def outlier_pages(spread: torch.Tensor, older: torch.Tensor, count: int) -> torch.Tensor:
    """bool ``[..., pages]``: the ``count`` pages with the widest ``spread`` among ``older`` ones
    (fewer where fewer are older; ties to the lower index)."""
    if count == 0 or spread.shape[-1] == 0:
        return torch.zeros_like(older)
    ranked = spread.masked_fill(~older, float("-inf"))
    best, index = ranked.topk(min(count, ranked.shape[-1]), dim=-1)
    chosen = torch.zeros_like(older).scatter_(-1, index, best > float("-inf"))
    return chosen & older


@register("shadowkv")
@dataclass
class ShadowKV(PageRetrieval):
    """ShadowKV (Sun et al., 2024, "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context
    LLM Inference"): the device keeps a small stand-in for every page's keys, the recent window
    and a few outlier pages; every other page's keys and values live on the host, and at each
    decode step only the pages the query scores highest are fetched from the host and attended
    over, with the window and the outliers.

    How this maps onto the paged store (a page is a chunk of ``page_size`` tokens of one KV head):

    - The device-side key stand-in is the page's channel-wise key minimum and maximum (the store's
      Quest summaries, ``2 * head_dim`` numbers per page), not the paper's low-rank SVD of the
      pre-RoPE keys: its landmark (the paper's chunk mean of post-RoPE keys) is the centre
      ``(min + max) / 2`` of the box the keys lie in. Keys are never reconstructed: a chosen page's
      exact keys and values are fetched (staged into the device's read buffer, not moved).
    - Scoring (the paper's): each query head's ``softmax`` over its pages of ``q . landmark /
      sqrt(head_dim)``, the largest over the query heads sharing a KV head (GQA), the ``pages``
      best per (row, KV head) among the pages outside the window and the outliers.
    - Outliers (the paper keeps the chunks whose keys are least similar to their landmark, in full,
      on the device): per head the ``outliers`` pages outside the window with the widest
      :func:`landmark_spread`, attended at every step.
    - Window: each head's ``window`` newest pages (the newest holds the current token), attended
      at every step.
    - Placement: after prefill (and prefill chunks) each layer's pages are ranked, the outliers
      first, then the window, newest first; the device keeps the best ``device_mb`` worth of them,
      the rest go to host memory (pinned under CUDA). New pages land on the device and push the
      oldest window page out, so the device keeps the sliding window and the outliers. Size
      ``device_mb`` to ``(window + outliers) * page_bytes * kv_heads * rows * layers`` (page
      bytes: ``page_size * (head_dim + value_dim) * element size``) to hold exactly those pages.
    - A head holding at most ``window + outliers + pages`` pages attends over all of them: the
      output is then exactly the full cache's. The first ``dense_layers`` layers and every
      multi-token call (prefill) attend over every page, read from whichever tier holds it.

    Args:
        pages: pages each (row, KV head) fetches and attends over at a decode step beyond its
            window and outliers (>= 0; the paper's top-k chunks).
        window: newest pages per head always attended and kept on the device (>= 1).
        outliers: pages per head with the widest landmark spread, always attended and kept on the
            device (>= 0).
        dense_layers: leading layers that always attend over every page (>= 0).
        device_mb: device budget for whole pages (keys and values), MiB over all layers (> 0),
            split evenly over layers (at least one page each); the key summaries and the step's
            staged pages come on top.
        host_mb: host budget, MiB over all layers (0: unbounded; past it a move raises
            :class:`~kvlib.errors.PoolExhaustedError`).
    """

    pages: int = 8
    window: int = 2
    outliers: int = 2
    dense_layers: int = 2
    device_mb: float = 64.0
    host_mb: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, least in (("pages", 0), ("window", 1), ("outliers", 0), ("dense_layers", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not self.device_mb > 0:
            raise ValueError(f"device_mb must be > 0 (MiB of whole pages on the device), got {self.device_mb}")
        if self.host_mb < 0:
            raise ValueError(f"host_mb must be >= 0 (0: unbounded), got {self.host_mb}")

    @property
    def pages_per_step(self) -> int:
        """Pages each (row, KV head) attends over at a sparse decode step, at most."""
        return self.window + self.outliers + self.pages

    def device_pages(self, num_layers: int, page_bytes: int) -> int:
        """Pages each layer may keep on the device."""
        return max(1, int(self.device_mb * 2**20 / (num_layers * page_bytes)))

    def host_pages(self, num_layers: int, page_bytes: int) -> int | None:
        """Pages each layer may keep on the host (None: unbounded)."""
        return None if not self.host_mb else max(1, int(self.host_mb * 2**20 / (num_layers * page_bytes)))

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        """Lowest-ranked pages leave the device first (:func:`~kvlib.placement.lowest_score_first`):
        pages outside the window and the outliers, then the window's oldest."""
        return lowest_score_first(pages)

    def refreshes_ranking(self, tokens_seen: int, query_length: int) -> bool:
        """After prefill and prefill chunks (decode steps only add pages, which land on the device)."""
        return query_length > 1

    def ranking_scores(self, view: LayerView) -> torch.Tensor:
        """Per-token placement scores ``[batch, kv_heads, slots]`` (a page takes its best token's):
        outlier pages ``OUTLIER_SCORE + spread``, window pages ``1 + slot / slots`` (newer higher),
        others 0; padding ``-inf``. Outliers are chosen as :meth:`select_pages` chooses them, from
        the min and max over every slot of the page (padding included, as the store's summaries)."""
        if view.page_size is None:
            raise ValueError("shadowkv ranks whole pages: the view must give page_size")
        batch, heads, slots, dim = view.keys.shape
        size = view.page_size
        count = -(-slots // size)
        paged = torch.nn.functional.pad(view.keys.float(), (0, 0, 0, count * size - slots)).view(batch, heads, count, size, dim)
        slot = torch.arange(count * size, device=paged.device)
        past_end = (slot >= slots).view(count, size, 1)
        spread = landmark_spread(paged.masked_fill(past_end, float("inf")).amin(3), paged.masked_fill(past_end, float("-inf")).amax(3))
        in_window = torch.arange(count, device=paged.device) >= count - self.window
        outlier = outlier_pages(spread, (~in_window).expand(batch, heads, count), self.outliers)
        page_scores = torch.where(outlier, OUTLIER_SCORE + spread, in_window.float())
        newer = torch.where(in_window.repeat_interleave(size), slot / slots, 0.0)  # window pages: newer higher, below 2
        scores = (page_scores.repeat_interleave(size, dim=-1) + newer)[..., :slots]
        return scores.masked_fill(~view.valid, float("-inf"))

    def sparse(self, layer_idx: int, query_length: int) -> bool:
        """Whether a layer call of ``query_length`` new tokens per row attends over chosen pages only."""
        return query_length == 1 and layer_idx >= self.dense_layers

    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The window, the outliers and the ``pages`` best-scored others: int64 ``[batch, kv_heads,
        min(window + outliers + pages, held pages)]`` on the CPU, indices into each head's block
        table, ascending, ``-1`` last where a head holds fewer pages."""
        batch, kv_heads, count, dim = key_min.shape
        used = pages_used.to(key_min.device).unsqueeze(-1)
        page = torch.arange(count, device=key_min.device)
        held = page < used
        in_window = held & (page >= used - self.window)
        outlier = outlier_pages(landmark_spread(key_min, key_max), held & ~in_window, self.outliers)
        candidate = held & ~in_window & ~outlier
        landmark = (key_min.float() + key_max.float()).mul(0.5)
        q = query[:, :, -1].float().view(batch, kv_heads, -1, dim)
        logits = torch.einsum("bhgd,bhpd->bhgp", q, landmark) / dim**0.5
        probs = logits.masked_fill(~candidate.unsqueeze(2), float("-inf")).softmax(-1).nan_to_num(0.0).amax(2)
        chosen = in_window | outlier
        if self.pages and count:
            best, index = probs.masked_fill(~candidate, -1.0).topk(min(self.pages, count), dim=-1)
            chosen = chosen | torch.zeros_like(chosen).scatter_(-1, index, best >= 0)
        width = min(self.pages_per_step, count)
        ordered = torch.where(chosen, page, count).sort(-1).values[..., :width]
        return torch.where(ordered == count, -1, ordered).cpu()
