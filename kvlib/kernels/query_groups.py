"""The query layout every paged kernel shares (numba, torch and Triton): the query heads of one
KV head (grouped-query attention, as transformers' ``repeat_kv``) read its keys and values
together, as one tile of ``group * queries`` query rows, row ``g * queries + q`` being query
``q`` of the group's ``g``-th head.
"""

from __future__ import annotations

import torch


def grouped_rows(query: torch.Tensor, pages: torch.Tensor, visible: torch.Tensor | None, query_positions: torch.Tensor | None) -> int:
    """Query rows per (row, KV head), ``group * queries``, of ``query [batch, query_heads, queries,
    head_dim]`` over a block table ``pages [batch, kv_heads, max_pages]``. ValueError where the
    query heads are not a multiple of the KV heads, or where neither the model's mask
    (``visible``) nor the queries' positions say what a query sees."""
    _, query_heads, queries, _ = query.shape
    kv_heads = pages.shape[1]
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of KV heads ({kv_heads})")
    if visible is None and query_positions is None:
        raise ValueError("paged_attention needs the model's mask (visible) or the queries' positions")
    return query_heads // kv_heads * queries
