"""Quest: query-aware page retrieval at each decode step (sparse attention, nothing evicted)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.placement import PageStats
from kvlib.policy import LayerView, PageRetrieval, Tiering
from kvlib.registry import register


@register("quest")
@dataclass
class Quest(PageRetrieval):
    """Quest (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
    Inference"): each page's channel-wise key minimum ``m`` and maximum ``M`` stay on the device
    (kept by the store as pages are written); at each decode step (one new token per row) a page
    of a (row, KV head) is scored by the upper bound ``sum_c max(q_c * m_c, q_c * M_c)`` of the
    query's dot product with any key in it, and attention runs over the ``top_k`` best pages only.
    Only those pages are read (with a host tier, only those host pages are copied to the device);
    nothing is evicted, and the next step may choose other pages. Prefill and multi-token calls
    attend over everything.

    Rules beyond the paper's bound:

    - GQA: the query heads sharing a KV head choose together; a page's score is the largest of
      their bounds (a page one head needs is kept for the group).
    - The page holding each head's newest tokens is always kept (it holds the current token).
    - A head holding at most ``top_k`` pages reads all of them: the output is then exactly the
      full cache's.
    - The first ``dense_layers`` layers always attend densely (the paper skips its first two
      layers, whose attention is not sparse).
    - Bounds use the keys after RoPE (what the store holds) and the query after RoPE; pages of
      left padding are scored like others (the mask still hides their tokens).

    Args:
        top_k: pages each (row, KV head) attends over at a decode step (>= 1), newest included.
        dense_layers: leading layers that always attend over every page (>= 0).
        placement: an optional device/host placement (``lru(...)`` or ``score_aware(...)``, a
            policy or a spec string) giving the page budgets and disk tier (and, for
            ``score_aware``, ranking pages after prefill and dense calls); without one every page
            stays on the device. Only the chosen pages are read, from whichever tier holds them.
    """

    top_k: int = 8
    dense_layers: int = 2
    placement: Tiering | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (pages per head and step), got {self.top_k}")
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")
        if self.placement is not None and self.placement.retrieves_pages:
            raise ValueError(f"placement must be a device/host placement such as lru(...), not {self.placement.spec()}")

    def device_pages(self, num_layers: int, page_bytes: int) -> int | None:
        return None if self.placement is None else self.placement.device_pages(num_layers, page_bytes)

    def host_pages(self, num_layers: int, page_bytes: int) -> int | None:
        return None if self.placement is None else self.placement.host_pages(num_layers, page_bytes)

    def disk_directory(self) -> str:
        return "" if self.placement is None else self.placement.disk_directory()

    def disk_pages(self, num_layers: int, record_bytes: int) -> int:
        return 0 if self.placement is None else self.placement.disk_pages(num_layers, record_bytes)

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        """The ``placement``'s rule (without one no page leaves the device)."""
        return super().leaving_order(pages) if self.placement is None else self.placement.leaving_order(pages)

    def refreshes_ranking(self, tokens_seen: int, query_length: int) -> bool:
        return self.placement is not None and self.placement.refreshes_ranking(tokens_seen, query_length)

    def prefetches(self) -> bool:
        """The ``placement``'s choice (``lru(..., prefetch=True)`` by default); none without one."""
        return self.placement is not None and self.placement.prefetches()

    def ranking_scores(self, view: LayerView) -> torch.Tensor:
        return self.placement.ranking_scores(view)

    def sparse(self, layer_idx: int, query_length: int) -> bool:
        """Whether a layer call of ``query_length`` new tokens per row attends over chosen pages only."""
        return query_length == 1 and layer_idx >= self.dense_layers

    def page_scores(self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
        """Quest's bound per page, float32 ``[batch, kv_heads, pages]``.

        ``query`` ``[batch, query_heads, 1, head_dim]`` (query heads grouped by KV head, as
        ``repeat_kv`` lays them out); ``key_min`` / ``key_max`` ``[batch, kv_heads, pages, head_dim]``.
        """
        batch, kv_heads, pages, dim = key_min.shape
        q = query[:, :, -1].float().view(batch, kv_heads, -1, 1, dim)
        low, high = key_min.float().unsqueeze(2), key_max.float().unsqueeze(2)
        return torch.maximum(q * low, q * high).sum(-1).amax(2)

    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The pages to attend over: int64 ``[batch, kv_heads, min(top_k, pages)]`` on the CPU, indices
        into each head's block table, ascending, ``-1`` last where a head holds fewer pages.

        ``pages_used`` int64 ``[batch, kv_heads]``: pages each head holds (its newest is the last).
        """
        scores = self.page_scores(query, key_min, key_max)
        used = pages_used.to(scores.device).unsqueeze(-1)
        page = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(page == used - 1, float("inf")).masked_fill(page >= used, float("-inf"))
        count = min(self.top_k, scores.shape[-1])
        best, index = scores.topk(count, dim=-1)
        past_end = scores.shape[-1]
        index = torch.where(best == float("-inf"), past_end, index).sort(-1).values
        return torch.where(index == past_end, -1, index).cpu()
