"""Attention weights of a few queries per row straight over a layer's pages (keys only), for the
eviction strategies that score with them after a step that attended over the pages: the scores
loop of :mod:`kvlib.kernels.paged_attention`'s kernel, kept per slot, then a softmax in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
import torch

from kvlib.kernels.page_kernel_parts import FASTMATH, kernel_queries, scores_into, seen_into

if TYPE_CHECKING:
    from kvlib.kernels.paged_attention import PageSource


@numba.njit(fastmath=FASTMATH)  # no cache=True: see kvlib.kernels.paged_attention.paged_attention_kernel
def _score_pair(
    grouped, keys, positions, page_ids, length, visible, query_positions, load_keys, scale, softcap, out
):  # pragma: no cover - compiled
    """One (row, KV head): ``out [rows, slots]`` gets each query row's score of the token in each
    of the head's first ``length`` slots (slot ``j * page_size + t`` is slot ``t`` of its ``j``-th
    page); unseen tokens and slots past ``length`` keep ``out``'s ``-inf``."""
    rows, dim = grouped.shape
    queries = visible.shape[0]
    page_size = positions.shape[1]
    key_page = np.empty((page_size, dim), dtype=np.float32)
    key_bits = key_page.view(np.uint32)
    seen = np.empty((queries, page_size), dtype=np.bool_)
    scores = np.empty(page_size, dtype=np.float32)
    for j in range((length + page_size - 1) // page_size):
        page = page_ids[j]
        filled = min(page_size, length - j * page_size)
        if not seen_into(seen, positions, page, filled, visible, query_positions):
            continue
        load_keys(keys, page, key_page, key_bits, filled)
        for r in range(rows):
            scores_into(scores, grouped, r, key_page, filled, seen[r % queries], scale, softcap)
            for t in range(filled):
                out[r, j * page_size + t] = scores[t]


@numba.njit(parallel=True)  # no cache=True: see kvlib.kernels.paged_attention.paged_attention_kernel
def _paged_scores_kernel(
    query, keys, positions, pages, lengths, visible, query_positions, load_keys, scale, softcap, out
):  # pragma: no cover - compiled
    batch, heads, rows, dim = query.shape
    for pair in numba.prange(batch * heads):
        b = pair // heads
        h = pair % heads
        _score_pair(
            query[b, h], keys, positions, pages[b, h], lengths[b, h], visible[b], query_positions, load_keys, scale, softcap, out[b, h]
        )


def attention_weights(
    query: torch.Tensor,
    source: PageSource,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The softmax attention weights of ``query`` over the stored tokens of a block table, read
    page by page (keys only; no dense copy of the layer): float32 ``[batch, query_heads, queries,
    slots]`` with ``slots = pages.shape[2] * page_size``, slot ``j * page_size + t`` being slot
    ``t`` of a head's ``j``-th page (the slot order of a dense read of the layer), 0 where the
    mask forbids, past a head's length, and for a query that sees no token. What an eviction
    strategy's ``attention`` needs on a step that attended over the pages; the arguments are
    :func:`kvlib.kernels.paged_attention.attend_pages`'s."""
    grouped, mask, steps = kernel_queries(query, pages, visible, query_positions)
    batch, query_heads, queries, _ = query.shape
    slots = pages.shape[2] * source.positions.shape[1]
    scores = torch.full((*grouped.shape[:3], slots), -torch.inf, dtype=torch.float32)
    _paged_scores_kernel(
        grouped.numpy(),
        source.keys,
        source.positions,
        pages.contiguous().numpy(),
        lengths.contiguous().numpy(),
        mask,
        steps,
        source.load_keys,
        np.float32(scale),
        np.float32(softcap or 0.0),
        scores.numpy(),
    )
    weights = torch.softmax(scores.view(batch, query_heads, queries, slots), dim=-1)
    return weights.nan_to_num_(0.0)  # a query that sees nothing: all -inf, softmax NaN
