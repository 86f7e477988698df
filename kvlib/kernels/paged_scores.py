"""Attention weights of a few queries per row straight over a layer's pages (keys only), for the
eviction policies that score with them after a step that attended over the pages: the scores
of :mod:`kvlib.kernels.paged_attention`'s kernel (float pages where they lie, sealed pages through
their codec's reader), kept per slot, then a softmax in torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np
import torch

from kvlib.kernels.host_arrays import FLOAT_KINDS, host_array
from kvlib.kernels.kernel_cache import cache_on_disk
from kvlib.kernels.page_kernel_parts import FASTMATH, RAW_PAGES, float_scores, gather_query, seen_into
from kvlib.kernels.page_readers import NumbaReader
from kvlib.kernels.pages import PageArrays
from kvlib.kernels.query_groups import grouped_rows


@functools.cache
def scores_kernel(keys: NumbaReader, raw_page: Callable) -> Callable:
    """The numba kernel of per-slot scores over pages whose sealed keys ``keys`` reads and whose
    raw pages ``raw_page`` reads: ``kernel(query, query_kind, raw_keys, raw_kind, sealed, raw_row,
    positions, pages, lengths, visible, query_positions, key_fields, scale, softcap, out)`` with
    ``out`` float32 ``[batch, kv_heads, rows, slots]`` (``-inf`` kept where unseen and past each
    head's length)."""
    prepare_keys, key_scores = keys.prepare_keys, keys.key_scores

    @numba.njit(fastmath=FASTMATH)
    def score_pair(
        query,
        query_kind,
        raw_keys,
        raw_kind,
        sealed,
        raw_row,
        positions,
        page_ids,
        length,
        visible,
        query_positions,
        key_fields,
        b,
        h,
        group,
        scale,
        softcap,
        out,
    ):  # pragma: no cover - compiled
        queries, dim = visible.shape[0], query.shape[3]
        rows = group * queries
        padded = rows if rows < 3 else (rows + 3) // 4 * 4
        page_size = positions.shape[1]
        q_rows = np.empty((padded, dim), dtype=np.float32)
        gather_query(query, query_kind, b, h, group, queries, q_rows)
        work = prepare_keys(key_fields, q_rows, h)
        scores = np.empty((padded, page_size), dtype=np.float32)
        seen = np.empty((queries, page_size), dtype=np.bool_)
        scratch = np.empty((page_size, dim), dtype=np.float32)
        coded = sealed.shape[0] > 0
        for j in range((length + page_size - 1) // page_size):
            page = page_ids[j]
            filled = min(page_size, length - j * page_size)
            if not seen_into(seen, positions, page, filled, visible, query_positions):
                continue
            if coded and sealed[page]:
                key_scores(key_fields, page, h, q_rows, work, filled, scores, scratch)
            else:
                float_scores(q_rows, raw_page(raw_keys, raw_row[page] if coded else page, filled, raw_kind, scratch), filled, scores)
            for r in range(rows):
                for t in range(filled):
                    if seen[r % queries, t]:
                        s = scores[r, t] * scale
                        if softcap > 0:
                            s = softcap * np.float32(np.tanh(s / softcap))
                        out[r, j * page_size + t] = s

    @numba.njit(parallel=True)
    def kernel(
        query,
        query_kind,
        raw_keys,
        raw_kind,
        sealed,
        raw_row,
        positions,
        pages,
        lengths,
        visible,
        query_positions,
        key_fields,
        scale,
        softcap,
        out,
    ):  # pragma: no cover - compiled
        batch, kv_heads = lengths.shape
        group = query.shape[1] // kv_heads
        for pair in numba.prange(batch * kv_heads):
            b, h = pair // kv_heads, pair % kv_heads
            score_pair(
                query,
                query_kind,
                raw_keys,
                raw_kind,
                sealed,
                raw_row,
                positions,
                pages[b, h],
                lengths[b, h],
                visible[b],
                query_positions,
                key_fields,
                b,
                h,
                group,
                scale,
                softcap,
                out[b, h],
            )

    return cache_on_disk(kernel)


def attention_weights(
    query: torch.Tensor,
    source: PageArrays,
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
    policy's ``attention`` needs on a step that attended over the pages; the arguments are
    :func:`kvlib.kernels.paged_attention.attend_pages`'s."""
    rows = grouped_rows(query, pages, visible, query_positions)
    if query.dtype not in FLOAT_KINDS:
        raise ValueError(f"queries must be one of {tuple(FLOAT_KINDS)}, got {query.dtype}")
    batch, query_heads, queries, _ = query.shape
    kv_heads = pages.shape[1]
    slots = pages.shape[2] * source.positions.shape[1]
    scores = torch.full((batch, kv_heads, rows, slots), -torch.inf, dtype=torch.float32)
    mask = np.zeros((batch, queries, 0), dtype=np.bool_) if visible is None else np.ascontiguousarray(host_array(visible))
    steps = np.zeros(0, dtype=np.int64) if query_positions is None else np.ascontiguousarray(host_array(query_positions))
    kernel = scores_kernel(source.key_reader, RAW_PAGES[source.keys.dtype])
    kernel(
        np.ascontiguousarray(host_array(query)),
        FLOAT_KINDS[query.dtype],
        source.keys,
        source.kind,
        source.sealed,
        source.raw_row,
        source.positions,
        np.ascontiguousarray(host_array(pages)),
        np.ascontiguousarray(host_array(lengths)),
        mask,
        steps,
        source.key_fields,
        np.float32(scale),
        np.float32(softcap or 0.0),
        host_array(scores),
    )
    weights = torch.softmax(scores.view(batch, query_heads, queries, slots), dim=-1)
    return weights.nan_to_num_(0.0)  # a query that sees nothing: all -inf, softmax NaN
