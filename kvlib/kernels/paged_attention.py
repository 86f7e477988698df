"""Attention of a few queries per row straight over a layer's pages: no dense copy of the cache.

:func:`paged_attention` computes what SDPA computes over the dense form of a layer
(:class:`~kvlib.storage.read_cache.LayerRead` with the model's mask moved onto the stored slots), but
reads each (row, KV head)'s keys and values page by page through the block table:

- queries ``[batch, query_heads, queries, head_dim]``; query head ``i`` uses KV head
  ``i // (query_heads // kv_heads)`` (grouped-query attention, as transformers' ``repeat_kv``);
- a stored token at original position ``p`` is visible to query ``q`` of row ``b`` iff the
  model's mask over logical positions allows it (``visible[b, q, p]``), or, with no mask,
  iff ``p <= query_positions[q]`` (causal); sliding windows, chunked masks and padding are in
  the model's mask, so they hold here unchanged;
- scores are ``scale * q.k``, optionally soft-capped (``softcap * tanh(s / softcap)``), and
  combined with an online softmax page by page (FlashAttention's rescaling), accumulated in
  float32 whatever the pages' dtype; a query that sees no token gets zeros.

CPU: a numba kernel, parallel over (row, KV head) pairs; each pair converts one page at a time
into float32 scratch of ``page_size`` rows (float16 and bfloat16 pages are read as their bits,
which numba's CPU target cannot load directly). Nothing but that scratch and the output is
allocated: memory traffic is the pages themselves. How a page reaches the scratch is a *loader*
per tensor, given with its arrays by a :class:`PageSource`: float arenas here
(:func:`arena_source`), a codec's fields decoded page by page for coded pools
(:mod:`kvlib.kernels.coded_page_loaders`). The inner loops are written to vectorize (LLVM fast-math
without ``nnan``/``ninf``): inner products four tokens per pass over the query, value sums four
tokens per pass over the accumulator, and a polynomial ``exp`` in place of libm's scalar call.

Other devices (CUDA): :mod:`kvlib.kernels.paged_attention_torch`, the same semantics with torch ops over
blocks of pages. :func:`kvlib.devices.paged_kernel` chooses per device; a :class:`PagedLayer`'s
source (a :class:`PageReader`) runs its own kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import numba
import numpy as np
import torch

from kvlib.kernels.page_kernel_parts import (
    FASTMATH,
    LOADERS,
    SUPPORTED_DTYPES,
    exp_into,
    kernel_queries,
    scores_into,
    seen_into,
)
from kvlib.kernels.paged_scores import attention_weights


@numba.njit(fastmath=FASTMATH)  # no cache=True: see paged_attention_kernel
def _attend_pair(
    grouped, keys, values, positions, page_ids, length, visible, query_positions, load_keys, load_values, scale, softcap, out, received
):  # pragma: no cover - compiled
    """One (row, KV head): ``out [rows, value_dim]`` for the query vectors ``grouped [rows, dim]``
    (row ``r`` is group ``r // queries``, query ``r % queries``) over the ``length`` tokens of
    pages ``page_ids``; ``visible [queries, logical]`` is the row's mask (``logical`` 0: causal
    by ``query_positions``). ``received`` (``[slots]``, or no slots: not asked for) gets, for each
    slot ``s < length``, the softmax weight each query gave it, summed over the queries and
    averaged over the group's heads (H2O's accumulated attention of one call), added to it."""
    rows, dim = grouped.shape
    queries = visible.shape[0]
    page_size = positions.shape[1]
    value_dim = out.shape[1]
    pages_used = (length + page_size - 1) // page_size
    keep = received.shape[0] > 0
    kept = np.empty((rows, pages_used * page_size if keep else 0), dtype=np.float32)  # each page's weights ...
    shift = np.full((rows, pages_used if keep else 0), -np.inf, dtype=np.float32)  # ... and the max they are relative to
    key_page = np.empty((page_size, dim), dtype=np.float32)
    value_page = np.empty((page_size, value_dim), dtype=np.float32)
    key_bits = key_page.view(np.uint32)
    value_bits = value_page.view(np.uint32)
    seen = np.empty((queries, page_size), dtype=np.bool_)
    scores = np.empty(page_size, dtype=np.float32)
    weights = np.empty(2 * page_size, dtype=np.float32)
    weight_bits = weights.view(np.int32)
    running_max = np.full(rows, -np.inf, dtype=np.float32)
    running_sum = np.zeros(rows, dtype=np.float32)
    acc = np.zeros((rows, value_dim), dtype=np.float32)
    for j in range(pages_used):
        page = page_ids[j]
        filled = min(page_size, length - j * page_size)
        if not seen_into(seen, positions, page, filled, visible, query_positions):
            continue
        load_keys(keys, page, key_page, key_bits, filled)
        load_values(values, page, value_page, value_bits, filled)
        for r in range(rows):
            q = r % queries
            page_max = scores_into(scores, grouped, r, key_page, filled, seen[q], scale, softcap)
            if page_max == -np.inf:
                continue
            new_max = max(running_max[r], page_max)
            if running_max[r] > -np.inf and new_max > running_max[r]:
                rescale = np.float32(math.exp(running_max[r] - new_max))
                running_sum[r] *= rescale
                for c in range(value_dim):
                    acc[r, c] *= rescale
            running_max[r] = new_max
            for t in range(filled):
                scores[t] -= new_max
            exp_into(scores, weights, weight_bits, filled)
            if keep:
                shift[r, j] = new_max
                for t in range(filled):
                    kept[r, j * page_size + t] = weights[t]
            t = 0
            while t + 4 <= filled:
                w0, w1, w2, w3 = weights[t], weights[t + 1], weights[t + 2], weights[t + 3]
                running_sum[r] += w0 + w1 + w2 + w3
                for c in range(value_dim):  # four tokens per pass over the accumulator
                    acc[r, c] += w0 * value_page[t, c] + w1 * value_page[t + 1, c] + w2 * value_page[t + 2, c] + w3 * value_page[t + 3, c]
                t += 4
            while t < filled:
                weight = weights[t]
                running_sum[r] += weight
                for c in range(value_dim):
                    acc[r, c] += weight * value_page[t, c]
                t += 1
    for r in range(rows):
        inverse = np.float32(1.0) / running_sum[r] if running_sum[r] > 0 else np.float32(0.0)
        for c in range(value_dim):
            out[r, c] = acc[r, c] * inverse
        if keep and running_sum[r] > 0:
            share = inverse * np.float32(queries) / np.float32(rows)  # the group's mean, each query's sum
            for j in range(pages_used):
                if shift[r, j] == -np.inf:
                    continue
                factor = np.float32(math.exp(shift[r, j] - running_max[r])) * share
                for t in range(min(page_size, length - j * page_size)):
                    received[j * page_size + t] += kept[r, j * page_size + t] * factor


@numba.njit(parallel=True)  # no cache=True: loaders are arguments, and numba's on-disk index keys them by
def paged_attention_kernel(  # dispatcher identity: never a hit in another process, and unsaveable (ReferenceError)
    query, keys, values, positions, pages, lengths, visible, query_positions, load_keys, load_values, scale, softcap, out, received
):  # pragma: no cover - compiled
    """:func:`_attend_pair` for every (row, KV head) of ``query [batch, kv_heads, rows, dim]``;
    ``received [batch, kv_heads, slots]`` (``slots`` 0: none asked for)."""
    batch, heads, rows, dim = query.shape
    for pair in numba.prange(batch * heads):
        b = pair // heads
        h = pair % heads
        _attend_pair(
            query[b, h],
            keys,
            values,
            positions,
            pages[b, h],
            lengths[b, h],
            visible[b],
            query_positions,
            load_keys,
            load_values,
            scale,
            softcap,
            out[b, h],
            received[b, h],
        )


class PageSource(NamedTuple):
    """A layer's pages as the kernel reads them, in place (CPU): for keys and for values a numba
    argument (an array, or a tuple of arrays and ints: a codec's fields) and the loader that writes
    the first ``rows`` tokens of one of its pages as float32 (``load(source, page, out, out_bits,
    rows)``, as :func:`~kvlib.kernels.page_kernel_parts.load_float32`: ``out [page_size, dim]``, ``out_bits`` the same scratch
    viewed as uint32); each page's token positions (int64 ``[capacity, page_size]``); the value
    channels. Each pool says how its pages are read (:meth:`~kvlib.storage.PagePool.page_source`)."""

    keys: object
    values: object
    load_keys: Callable[..., None]
    load_values: Callable[..., None]
    positions: np.ndarray
    value_dim: int

    def attend(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attend_pages` of ``query`` over these pages (the CPU kernel); ``options``: its
        keyword arguments."""
        return attend_pages(query, self, pages, lengths, **options)

    def weights(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attention_weights` of ``query`` over these pages (the CPU kernel)."""
        return attention_weights(query, self, pages, lengths, **options)


def _numpy_pages(arena: torch.Tensor) -> np.ndarray:
    """A CPU arena as numpy: float32 as it is, float16 and bfloat16 as their 16-bit patterns."""
    if arena.dtype == torch.float32:
        return arena.numpy()
    return arena.view(torch.int16).numpy().view(np.uint16)


def arena_source(key_arena: torch.Tensor, value_arena: torch.Tensor, positions: torch.Tensor) -> PageSource:
    """The :class:`PageSource` of pages held in the compute dtype: arenas ``[capacity, page_size,
    head_dim | value_dim]`` in one of :data:`SUPPORTED_DTYPES` (keys and values alike), on the CPU."""
    if key_arena.dtype not in SUPPORTED_DTYPES or value_arena.dtype != key_arena.dtype:
        raise ValueError(f"pages must be one of {SUPPORTED_DTYPES} (keys and values alike), got {key_arena.dtype} / {value_arena.dtype}")
    load = LOADERS[key_arena.dtype]
    return PageSource(_numpy_pages(key_arena), _numpy_pages(value_arena), load, load, positions.numpy(), value_arena.shape[2])


def paged_attention(
    query: torch.Tensor,
    key_arena: torch.Tensor,
    value_arena: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over the stored tokens named by a block table, page by page.

    Args:
        query: ``[batch, query_heads, queries, head_dim]`` (after RoPE), float32/16 or bfloat16.
        key_arena, value_arena: a layer's pages, ``[capacity, page_size, head_dim]`` and
            ``[capacity, page_size, value_dim]``, in one of :data:`SUPPORTED_DTYPES`.
        positions: int64 ``[capacity, page_size]``, each stored token's original position.
        pages: int64 ``[batch, kv_heads, max_pages]``, page ids of each (row, KV head) in order.
        lengths: int64 ``[batch, kv_heads]``, tokens stored per (row, KV head).
        visible: bool ``[batch, queries, logical_length]``, the model's mask over logical
            positions (which position each query may see), or None for causal visibility by
            ``query_positions``.
        query_positions: int64 ``[queries]``, each query's logical position (used when
            ``visible`` is None).
        scale: multiplier of ``q.k`` (usually ``head_dim ** -0.5``).
        softcap: tanh soft-capping of scores, or None.

    Returns:
        ``[batch, query_heads, queries, value_dim]`` in ``query``'s dtype (float32 accumulation).
        Every tensor must be on the CPU (CUDA: :func:`kvlib.kernels.paged_attention_torch.attend_pages_torch`,
        the same semantics with torch ops; :func:`kvlib.devices.paged_kernel` chooses).
    """
    source = arena_source(key_arena, value_arena, positions)
    return attend_pages(query, source, pages, lengths, visible=visible, query_positions=query_positions, scale=scale, softcap=softcap)


def attend_pages(
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
    """:func:`paged_attention` over pages however they are held (``source``: float arenas, or a
    codec's fields decoded page by page inside the kernel); the other arguments are its own."""
    grouped, mask, steps = kernel_queries(query, pages, visible, query_positions)
    batch, query_heads, queries, _ = query.shape
    out = torch.empty(*grouped.shape[:3], source.value_dim, dtype=torch.float32)
    paged_attention_kernel(
        grouped.numpy(),
        source.keys,
        source.values,
        source.positions,
        pages.contiguous().numpy(),
        lengths.contiguous().numpy(),
        mask,
        steps,
        source.load_keys,
        source.load_values,
        np.float32(scale),
        np.float32(softcap or 0.0),
        out.numpy(),
        np.zeros((*out.shape[:2], 0), dtype=np.float32),
    )
    return out.view(batch, query_heads, queries, -1).to(query.dtype)


class PageReader(Protocol):
    """A layer's pages as some paged kernel reads them in place: :class:`PageSource` (the CPU
    kernel here) or :class:`~kvlib.kernels.paged_attention_torch.TorchPageSource` (torch ops, any device),
    chosen per device by :func:`kvlib.devices.paged_kernel`."""

    value_dim: int

    def attend(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`paged_attention` of ``query`` over these pages through the block table
        ``pages`` holding ``lengths`` tokens per (row, KV head)."""

    def weights(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attention_weights` of ``query`` over these pages (slots in block-table order)."""


class PagedLayer(NamedTuple):
    """A layer's tokens for a batch of sequences, as they lie in the pages (nothing copied).

    source: how a paged kernel reads the layer's pages (a :class:`PageReader`); pages: int64
    ``[batch, kv_heads, max_pages]``, each (row, KV head)'s page ids in order (``-1`` past its
    last page); lengths: int64 ``[batch, kv_heads]``, tokens stored per (row, KV head).
    """

    source: PageReader
    pages: torch.Tensor
    lengths: torch.Tensor

    def attend(self, query: torch.Tensor, **options) -> torch.Tensor:
        """:func:`paged_attention` of ``query`` over these pages by their source's kernel;
        ``options``: its keyword arguments (``visible``, ``query_positions``, ``scale``, ``softcap``)."""
        return self.source.attend(query, self.pages, self.lengths, **options)

    def weights(self, query: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attention_weights` of ``query`` over these pages by their source's kernel (slots
        in block-table order, as a dense read of the layer lays them out); ``options`` as for
        :meth:`attend`."""
        return self.source.weights(query, self.pages, self.lengths, **options)
