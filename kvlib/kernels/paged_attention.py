"""Attention of a few queries per row straight over a layer's pages: no dense copy of the cache.

:func:`paged_attention` computes what SDPA computes over the dense form of a layer
(:class:`~kvlib.storage.layers.read_cache.LayerRead` with the model's mask moved onto the stored slots), but
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

CPU: a numba kernel. The work is cut into items, each a run of one (row, KV head)'s pages (its
*split*: several per pair where there are fewer pairs than threads to keep busy, as
FlashDecoding splits a long context), run in parallel and merged by their maxima and sums. An
item reads each page where it lies: float pages straight from the arena (float16 and bfloat16
widened into ``page_size`` rows of scratch), a codec's sealed pages through its
:class:`~kvlib.kernels.page_readers.NumbaReader`, which scores and accumulates them with the
codec's scales folded into the query or the weights. The GQA group's query rows are scored
together, four per pass over a key; values are summed four tokens and four rows per pass over
the accumulator; ``exp`` is a polynomial over a whole page of rows (all in
:mod:`kvlib.kernels.page_kernel_parts`, written to vectorize under LLVM fast-math without
``nnan``/``ninf``). Nothing but per-item scratch and the output is allocated.

A :class:`PageSource` holds a layer's pages as the kernel reads them: float arenas
(:func:`arena_source`) or a coded pool's open pages raw and sealed pages through its codec's
readers (:func:`coded_source`). Other devices: :mod:`kvlib.kernels.paged_attention_torch` (torch ops
over blocks of pages) and :mod:`kvlib.kernels.paged_attention_triton`; :func:`kvlib.devices.paged_kernel`
chooses per device; a :class:`PagedLayer`'s source (a :class:`PageReader`) runs its own kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numba
import numpy as np
import torch

from kvlib.kernel_readers import KernelReader
from kvlib.kernels.host_arrays import FLOAT_KINDS, float_bits, host_array
from kvlib.kernels.kernel_cache import cache_on_disk
from kvlib.kernels.page_kernel_parts import (
    FASTMATH,
    RAW_PAGES,
    SUPPORTED_DTYPES,
    float_accumulate,
    float_scores,
    gather_query,
    seen_into,
    softmax_page,
)
from kvlib.kernels.page_readers import FLOAT_ARENAS, NumbaReader, numba_reader
from kvlib.kernels.paged_scores import attention_weights
from kvlib.kernels.pages import PageArrays
from kvlib.kernels.query_groups import grouped_rows

MIN_SPLIT_PAGES = 32
"""The fewest pages a split of one (row, KV head) covers (512 tokens at 16 a page)."""

_NO_PAGES = np.zeros(0, dtype=np.bool_)
_NO_ROWS = np.zeros(0, dtype=np.int64)
NO_LSE = np.zeros((0, 0, 0), dtype=np.float32)
"""The kernel's ``lse`` argument when no log-sum-exp is asked for."""


@functools.cache
def attention_kernel(keys: NumbaReader, values: NumbaReader, raw_page: Callable) -> Callable:
    """The numba kernel over pages whose sealed keys and values ``keys`` and ``values`` read and
    whose raw pages ``raw_page`` reads (:data:`~kvlib.kernels.page_kernel_parts.RAW_PAGES`); compiled
    once per combination (and argument types), on first use:

    ``kernel(query, query_kind, raw_keys, raw_values, raw_kind, sealed, raw_row, positions,
    pages, lengths, visible, query_positions, key_fields, value_fields, scale, softcap, splits,
    out, received, lse)`` with ``query [batch, query_heads, queries, head_dim]`` (float32, or uint16
    bits of ``query_kind``), ``out`` float32 ``[batch, queries, query_heads, value_dim]``,
    ``received`` float32 ``[batch, kv_heads, slots]`` (no slots: not asked for) and ``lse``
    float32 ``[batch, queries, query_heads]`` (each query's log-sum-exp of its scaled scores,
    ``-inf`` where it sees nothing; no elements: not asked for), the rest as
    :class:`PageSource` and :func:`attend_pages` hold them."""
    prepare_keys, key_scores = keys.prepare_keys, keys.key_scores
    prepare_values, accumulate_values, finish_values = values.prepare_values, values.accumulate_values, values.finish_values

    @numba.njit(fastmath=FASTMATH)
    def attend_item(
        query,
        query_kind,
        raw_keys,
        raw_values,
        raw_kind,
        sealed,
        raw_row,
        positions,
        page_ids,
        first,
        end,
        length,
        visible,
        query_positions,
        key_fields,
        value_fields,
        b,
        h,
        group,
        scale,
        softcap,
        item_acc,
        item_max,
        item_sum,
        kept,
        shift,
    ):  # pragma: no cover - compiled
        """Pages ``[first, end)`` of KV head ``h`` of row ``b``: the unnormalized accumulator, max
        and sum of each query row into ``item_acc``, ``item_max``, ``item_sum``; with ``kept``
        (``[padded, slots]``, else no rows) each page's weights and the max they are relative to
        (``shift [padded, pages]``)."""
        queries, dim = visible.shape[0], query.shape[3]
        padded, value_dim = item_acc.shape
        page_size = positions.shape[1]
        rows = group * queries
        q_rows = np.empty((padded, dim), dtype=np.float32)
        gather_query(query, query_kind, b, h, group, queries, q_rows)
        work = prepare_keys(key_fields, q_rows, h)
        state = prepare_values(value_fields, padded, value_dim)
        acc = np.zeros((padded, value_dim), dtype=np.float32)
        running_max = np.full(padded, -np.inf, dtype=np.float32)
        running_sum = np.zeros(padded, dtype=np.float32)
        scores = np.empty((padded, page_size), dtype=np.float32)
        flat = np.empty(2 * padded * page_size, dtype=np.float32)
        weights = flat.reshape((2 * padded, page_size))  # rows [0, padded): the weights; the rest exp's scratch
        bits = flat.view(np.int32)
        seen = np.empty((queries, page_size), dtype=np.bool_)
        key_scratch = np.empty((page_size, dim), dtype=np.float32)
        value_scratch = np.empty((page_size, value_dim), dtype=np.float32)
        coded = sealed.shape[0] > 0
        keep = kept.shape[0] > 0
        for j in range(first, end):
            page = page_ids[j]
            filled = min(page_size, length - j * page_size)
            if not seen_into(seen, positions, page, filled, visible, query_positions):
                continue
            is_sealed = coded and sealed[page]
            row = raw_row[page] if coded else page
            if is_sealed:
                key_scores(key_fields, page, h, q_rows, work, filled, scores, key_scratch)
            else:
                float_scores(q_rows, raw_page(raw_keys, row, filled, raw_kind, key_scratch), filled, scores)
            if not softmax_page(scores, rows, queries, filled, seen, scale, softcap, running_max, running_sum, acc, state, flat, bits):
                continue
            if keep:
                for r in range(rows):
                    shift[r, j] = running_max[r]
                    for t in range(filled):
                        kept[r, j * page_size + t] = weights[r, t]
            if is_sealed:
                accumulate_values(value_fields, page, h, weights, filled, acc, state, value_scratch)
            else:
                float_accumulate(weights, raw_page(raw_values, row, filled, raw_kind, value_scratch), filled, acc)
        finish_values(value_fields, acc, state, h)
        for r in range(padded):
            item_max[r] = running_max[r]
            item_sum[r] = running_sum[r]
            for c in range(value_dim):
                item_acc[r, c] = acc[r, c]

    @numba.njit(parallel=True)
    def kernel(
        query,
        query_kind,
        raw_keys,
        raw_values,
        raw_kind,
        sealed,
        raw_row,
        positions,
        pages,
        lengths,
        visible,
        query_positions,
        key_fields,
        value_fields,
        scale,
        softcap,
        splits,
        out,
        received,
        lse,
    ):  # pragma: no cover - compiled
        batch, kv_heads = lengths.shape
        query_heads, queries = query.shape[1], query.shape[2]
        group = query_heads // kv_heads
        rows = group * queries
        padded = rows if rows < 3 else (rows + 3) // 4 * 4
        value_dim = out.shape[3]
        page_size = positions.shape[1]
        pairs = batch * kv_heads
        items = pairs * splits
        item_acc = np.zeros((items, padded, value_dim), dtype=np.float32)
        item_max = np.full((items, padded), -np.inf, dtype=np.float32)
        item_sum = np.zeros((items, padded), dtype=np.float32)
        keep = received.shape[2] > 0
        sums = lse.size > 0
        kept = np.zeros((pairs, padded if keep else 0, pages.shape[2] * page_size if keep else 0), dtype=np.float32)
        shift = np.full((pairs, padded if keep else 0, pages.shape[2] if keep else 0), -np.inf, dtype=np.float32)
        for item in numba.prange(items):
            pair = item // splits
            b, h = pair // kv_heads, pair % kv_heads
            length = lengths[b, h]
            per_split = ((length + page_size - 1) // page_size + splits - 1) // splits
            first = (item % splits) * per_split
            end = min((length + page_size - 1) // page_size, first + per_split)
            attend_item(
                query,
                query_kind,
                raw_keys,
                raw_values,
                raw_kind,
                sealed,
                raw_row,
                positions,
                pages[b, h],
                first,
                end,
                length,
                visible[b],
                query_positions,
                key_fields,
                value_fields,
                b,
                h,
                group,
                scale,
                softcap,
                item_acc[item],
                item_max[item],
                item_sum[item],
                kept[pair],
                shift[pair],
            )
        best = np.full((pairs, rows), -np.inf, dtype=np.float32)
        total = np.zeros((pairs, rows), dtype=np.float32)
        for pair in range(pairs):  # the merge: a few rows per pair, not worth waking the threads
            b, h = pair // kv_heads, pair % kv_heads
            for r in range(rows):
                for s in range(splits):
                    best[pair, r] = max(best[pair, r], item_max[pair * splits + s, r])
                for s in range(splits):
                    if item_max[pair * splits + s, r] > -np.inf:
                        total[pair, r] += (
                            np.float32(math.exp(item_max[pair * splits + s, r] - best[pair, r])) * item_sum[pair * splits + s, r]
                        )
                head, q = h * group + r // queries, r % queries
                target = out[b, q, head]
                for c in range(value_dim):
                    target[c] = np.float32(0.0)
                if sums:
                    lse[b, q, head] = best[pair, r] + np.float32(math.log(total[pair, r])) if total[pair, r] > 0 else -np.inf
                if total[pair, r] <= 0:
                    continue
                for s in range(splits):
                    if item_max[pair * splits + s, r] > -np.inf:
                        factor = np.float32(math.exp(item_max[pair * splits + s, r] - best[pair, r])) / total[pair, r]
                        source = item_acc[pair * splits + s, r]
                        for c in range(value_dim):
                            target[c] += source[c] * factor
        if keep:
            for pair in numba.prange(pairs):
                b, h = pair // kv_heads, pair % kv_heads
                length = lengths[b, h]
                for r in range(rows):
                    if total[pair, r] <= 0:
                        continue
                    share = np.float32(queries) / (np.float32(rows) * total[pair, r])  # the group's mean of each query's sum
                    for j in range((length + page_size - 1) // page_size):
                        if shift[pair, r, j] == -np.inf:
                            continue
                        factor = np.float32(math.exp(shift[pair, r, j] - best[pair, r])) * share
                        for t in range(min(page_size, length - j * page_size)):
                            slot = j * page_size + t
                            if slot < received.shape[2]:
                                received[b, h, slot] += kept[pair, r, slot] * factor

    return cache_on_disk(kernel)


class PageSource(PageArrays):
    """:class:`~kvlib.kernels.pages.PageArrays` that the CPU kernels here read: a
    :class:`~kvlib.kernels.pages.PageReader`."""

    __slots__ = ()

    def attend(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attend_pages` of ``query`` over these pages (the CPU kernel); ``options``: its
        keyword arguments."""
        return attend_pages(query, self, pages, lengths, **options)

    def attend_parts(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`attend_parts` of ``query`` over these pages (the CPU kernel): float32 output and log-sum-exps."""
        return attend_parts(query, self, pages, lengths, **options)

    def weights(self, query: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """:func:`attention_weights` of ``query`` over these pages (the CPU kernel)."""
        return attention_weights(query, self, pages, lengths, **options)


def run_kernel(
    source: PageSource,
    query: np.ndarray,
    query_kind: int,
    pages: np.ndarray,
    lengths: np.ndarray,
    visible: np.ndarray,
    query_positions: np.ndarray,
    scale: float,
    softcap: float | None,
    out: np.ndarray,
    received: np.ndarray,
    lse: np.ndarray = NO_LSE,
) -> None:
    """:func:`attention_kernel` over ``source``'s pages, on host arrays: ``query`` ``[batch,
    query_heads, queries, head_dim]`` (float32, or uint16 bits of ``query_kind``), ``pages`` int64
    ``[batch, kv_heads, max_pages]`` and ``lengths`` int64 ``[batch, kv_heads]``, ``visible`` bool
    ``[batch, queries, logical]`` (no columns: causal by ``query_positions``, int64 ``[queries]``),
    ``out`` float32 ``[batch, queries, query_heads, value_dim]`` (written), ``received`` float32
    ``[batch, kv_heads, slots]`` (added to; no slots: not asked for), ``lse`` float32 ``[batch,
    queries, query_heads]`` (written: each query's log-sum-exp; :data:`NO_LSE`: not asked for).
    Every array C-contiguous."""
    kernel = attention_kernel(source.key_reader, source.value_reader, RAW_PAGES[source.keys.dtype])
    kernel(
        query,
        query_kind,
        source.keys,
        source.values,
        source.kind,
        source.sealed,
        source.raw_row,
        source.positions,
        pages,
        lengths,
        visible,
        query_positions,
        source.key_fields,
        source.value_fields,
        np.float32(scale),
        np.float32(softcap or 0.0),
        split_count(lengths, source.positions.shape[1]),
        out,
        received,
        lse,
    )


def split_count(lengths: np.ndarray, page_size: int) -> int:
    """Splits per (row, KV head) so that the kernel's items keep its threads busy: one where
    there are pairs enough (or one thread), else enough for two items per thread, each split
    covering at least :data:`MIN_SPLIT_PAGES` of the longest head's pages."""
    threads = numba.get_num_threads()
    pairs = lengths.size
    if threads == 1 or pairs >= 2 * threads or pairs == 0:
        return 1
    longest = int(lengths.max())
    return max(1, min(-(-2 * threads // pairs), (longest + page_size - 1) // page_size // MIN_SPLIT_PAGES))


def arena_source(key_arena: torch.Tensor, value_arena: torch.Tensor, positions: torch.Tensor) -> PageSource:
    """The :class:`PageSource` of pages held in the compute dtype: arenas ``[capacity, page_size,
    head_dim | value_dim]`` in one of :data:`SUPPORTED_DTYPES` (keys and values alike), on the CPU."""
    if key_arena.dtype not in SUPPORTED_DTYPES or value_arena.dtype != key_arena.dtype:
        raise ValueError(f"pages must be one of {SUPPORTED_DTYPES} (keys and values alike), got {key_arena.dtype} / {value_arena.dtype}")
    keys, kind = float_bits(key_arena)
    return PageSource(
        keys,
        host_array(value_arena),
        kind,
        _NO_PAGES,
        _NO_ROWS,
        host_array(positions),
        FLOAT_ARENAS,
        (),
        FLOAT_ARENAS,
        (),
        value_arena.shape[2],
        (key_arena, value_arena, positions),
    )


def coded_source(
    raw_keys: torch.Tensor,
    raw_values: torch.Tensor,
    sealed: torch.Tensor,
    raw_row: torch.Tensor,
    positions: torch.Tensor,
    keys: KernelReader,
    values: KernelReader,
) -> PageSource:
    """The :class:`PageSource` of a coded pool's pages (:class:`~kvlib.storage.pools.formats.coded_format.CodedPages`'s
    layout): open pages in the raw arenas ``[raw_rows, page_size, head_dim | value_dim]`` (one of
    :data:`SUPPORTED_DTYPES`) at ``raw_row`` (int64 ``[capacity]``), sealed ones (bool ``sealed
    [capacity]``) read by the numba readers ``keys`` and ``values`` name; ``positions`` int64
    ``[capacity, page_size]``. Every tensor on the CPU; no copy."""
    if raw_keys.dtype not in SUPPORTED_DTYPES or raw_values.dtype != raw_keys.dtype:
        raise ValueError(f"open pages must be one of {SUPPORTED_DTYPES}, got {raw_keys.dtype} / {raw_values.dtype}")
    key_reader, value_reader = numba_reader(keys.kernel), numba_reader(values.kernel)
    raw, kind = float_bits(raw_keys)
    return PageSource(
        raw,
        host_array(raw_values),
        kind,
        host_array(sealed),
        host_array(raw_row),
        host_array(positions),
        key_reader,
        key_reader.fields(keys.fields, keys.params),
        value_reader,
        value_reader.fields(values.fields, values.params),
        raw_values.shape[2],
        (raw_keys, raw_values, sealed, raw_row, positions, keys, values),
    )


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
    coded pool's open pages raw and sealed pages through its codec's readers); the other
    arguments are its own."""
    out, _ = _attend(query, source, pages, lengths, visible, query_positions, scale, softcap, with_lse=False)
    return out.to(query.dtype)


def attend_parts(
    query: torch.Tensor,
    source: PageSource,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    *,
    visible: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_pages` as a partial attention, to be merged with attention over other tokens
    (:mod:`kvlib.kernels.shared_prefix`): the output in float32 ``[batch, query_heads, queries,
    value_dim]`` (not rounded to the query's dtype) and each query's log-sum-exp of its scaled
    (soft-capped) scores over the tokens it sees, float32 ``[batch, query_heads, queries]``
    (``-inf`` where it sees none, its output then zeros)."""
    return _attend(query, source, pages, lengths, visible, query_positions, scale, softcap, with_lse=True)


def _attend(
    query, source, pages, lengths, visible, query_positions, scale, softcap, *, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU kernel's float32 output ``[batch, query_heads, queries, value_dim]`` and, with
    ``with_lse``, its log-sum-exps ``[batch, query_heads, queries]`` (else None); both views."""
    grouped_rows(query, pages, visible, query_positions)
    batch, query_heads, queries, _ = query.shape
    out = torch.empty(batch, queries, query_heads, source.value_dim, dtype=torch.float32)
    lse = torch.empty(batch, queries, query_heads, dtype=torch.float32) if with_lse else None
    run_kernel(
        source,
        *kernel_query(query),
        np.ascontiguousarray(host_array(pages)),
        np.ascontiguousarray(host_array(lengths)),
        kernel_visibility(visible, batch, queries),
        kernel_positions(query_positions),
        scale,
        softcap,
        host_array(out),
        np.zeros((batch, pages.shape[1], 0), dtype=np.float32),
        NO_LSE if lse is None else host_array(lse),
    )
    return out.transpose(1, 2), None if lse is None else lse.transpose(1, 2)


def kernel_query(query: torch.Tensor) -> tuple[np.ndarray, int]:
    """``query`` as the kernel reads it: a C-contiguous host array (float32, or 16-bit bits) and
    its float kind (:data:`~kvlib.kernels.host_arrays.FLOAT_KINDS`)."""
    if query.dtype not in FLOAT_KINDS:
        raise ValueError(f"queries must be one of {tuple(FLOAT_KINDS)}, got {query.dtype}")
    return np.ascontiguousarray(host_array(query)), FLOAT_KINDS[query.dtype]


def kernel_visibility(visible: torch.Tensor | None, batch: int, queries: int) -> np.ndarray:
    """The model's mask over logical positions as the kernel reads it: bool ``[batch, queries,
    logical]``, C-contiguous; no columns for causal visibility."""
    if visible is None:
        return np.zeros((batch, queries, 0), dtype=np.bool_)
    return np.ascontiguousarray(host_array(visible))


def kernel_positions(query_positions: torch.Tensor | None) -> np.ndarray:
    """The queries' logical positions as the kernel reads them (int64; empty with a mask)."""
    return _NO_ROWS if query_positions is None else np.ascontiguousarray(host_array(query_positions))
