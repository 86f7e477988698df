"""Attention of a few queries per row straight over a layer's pages: no dense copy of the cache.

:func:`paged_attention` computes what SDPA computes over the dense form of a layer
(:class:`~kvlib.read_cache.LayerRead` with the model's mask moved onto the stored slots), but
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
(:mod:`kvlib.coded_page_loaders`). The inner loops are written to vectorize (LLVM fast-math
without ``nnan``/``ninf``): inner products four tokens per pass over the query, value sums four
tokens per pass over the accumulator, and a polynomial ``exp`` in place of libm's scalar call.

Other devices (CUDA): :mod:`kvlib.paged_attention_torch`, the same semantics with torch ops over
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

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Page dtypes the kernel reads."""



@numba.njit(inline="always")
def _half_to_float(bits: np.uint16) -> np.float32:
    """IEEE 754 binary16 bits to float32 (subnormals, infinities and NaN included)."""
    sign = -1.0 if (bits >> 15) & 1 else 1.0
    exponent = (bits >> 10) & 0x1F
    fraction = bits & 0x3FF
    if exponent == 0:
        return np.float32(sign * math.ldexp(fraction, -24))
    if exponent == 31:
        return np.float32(sign * np.inf) if fraction == 0 else np.float32(np.nan)
    return np.float32(sign * math.ldexp(fraction + 1024, exponent - 25))


@numba.njit(inline="always")
def _load_float32(arena, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """``out[:rows] = arena[page, :rows]`` (float32 pages)."""
    for t in range(rows):
        for c in range(out.shape[1]):
            out[t, c] = arena[page, t, c]


@numba.njit(inline="always")
def _load_float16(arena, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """``out[:rows] = arena[page, :rows]`` as float32 (float16 pages, given as their bits)."""
    for t in range(rows):
        for c in range(out.shape[1]):
            out[t, c] = _half_to_float(arena[page, t, c])


@numba.njit(inline="always")
def _load_bfloat16(arena, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """``out[:rows] = arena[page, :rows]`` as float32 (bfloat16 pages, given as their bits: a
    bfloat16 is a float32's top half; ``out_bits`` is ``out`` viewed as uint32)."""
    for t in range(rows):
        for c in range(out.shape[1]):
            out_bits[t, c] = np.uint32(arena[page, t, c]) << np.uint32(16)


FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
"""LLVM's fast-math flags the kernel allows: reordered sums (so inner products and value sums
vectorize), fused multiply-adds; not ``nnan``/``ninf``, since masked scores are ``-inf``."""


LOG2E = np.float32(1.4426950408889634)
LN2_HIGH = np.float32(0.693359375)
LN2_LOW = np.float32(-2.12194440e-4)
EXP_FLOOR = np.float32(-87.0)
"""Below this exp underflows float32's normal range; such scores (and ``-inf``) weigh 0."""


@numba.njit(inline="always", fastmath=FASTMATH)
def _exp_into(x, out, bits, count):  # pragma: no cover - compiled
    """``out[:count] = exp(x[:count])`` for ``x <= 0``, float32: Cephes' ``expf`` (``2**n`` times a
    degree-7 polynomial of the remainder in ``[-ln2/2, ln2/2]``; relative error ~2e-7), written as
    two branch-free loops so both vectorize. ``out`` holds ``2 * count`` floats (the second half
    is scratch for ``2**n``), ``bits`` is ``out`` viewed as int32."""
    for t in range(count):
        y = max(x[t], EXP_FLOOR)
        n = np.floor(y * LOG2E + np.float32(0.5))
        r = y - n * LN2_HIGH - n * LN2_LOW
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        out[t] = (p * r * r + r + np.float32(1.0)) if x[t] > EXP_FLOOR else np.float32(0.0)
        bits[count + t] = (np.int32(n) + np.int32(127)) << np.int32(23)
    for t in range(count):
        out[t] *= out[count + t]


@numba.njit(inline="always")
def _seen_into(seen, positions, page, filled, visible, query_positions) -> bool:  # pragma: no cover - compiled
    """``seen[q, t]``: whether query ``q`` sees the token in slot ``t`` of ``page`` (its first
    ``filled`` slots), by the row's mask ``visible [queries, logical]`` at the token's position,
    or causally by ``query_positions`` when the mask has no columns. Returns whether any does."""
    use_mask = visible.shape[1] > 0
    any_seen = False
    for q in range(seen.shape[0]):
        for t in range(filled):
            position = positions[page, t]
            if use_mask:
                seen[q, t] = 0 <= position < visible.shape[1] and visible[q, position]
            else:
                seen[q, t] = 0 <= position <= query_positions[q]
            any_seen |= seen[q, t]
    return any_seen


@numba.njit(inline="always", fastmath=FASTMATH)
def _scores_into(scores, grouped, r, key_page, filled, seen, scale, softcap):  # pragma: no cover - compiled
    """``scores[:filled]``: query row ``r`` of ``grouped`` against the first ``filled`` keys of
    ``key_page``, times ``scale``, soft-capped when ``softcap > 0``, ``-inf`` where not ``seen``.
    Returns their maximum. Four tokens per pass over the query: four vectorized sums."""
    dim = grouped.shape[1]
    page_max = np.float32(-np.inf)
    t = 0
    while t + 4 <= filled:
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for c in range(dim):
            x = grouped[r, c]
            s0 += x * key_page[t, c]
            s1 += x * key_page[t + 1, c]
            s2 += x * key_page[t + 2, c]
            s3 += x * key_page[t + 3, c]
        scores[t] = s0
        scores[t + 1] = s1
        scores[t + 2] = s2
        scores[t + 3] = s3
        t += 4
    while t < filled:
        s = np.float32(0.0)
        for c in range(dim):
            s += grouped[r, c] * key_page[t, c]
        scores[t] = s
        t += 1
    for t in range(filled):
        s = scores[t] * scale
        if softcap > 0:
            s = softcap * math.tanh(s / softcap)
        scores[t] = s if seen[t] else -np.inf
        page_max = max(page_max, scores[t])
    return page_max


@numba.njit(fastmath=FASTMATH)  # no cache=True: see _paged_attention_kernel
def _attend_pair(
    grouped, keys, values, positions, page_ids, length, visible, query_positions, load_keys, load_values, scale, softcap, out
):  # pragma: no cover - compiled
    """One (row, KV head): ``out [rows, value_dim]`` for the query vectors ``grouped [rows, dim]``
    (row ``r`` is group ``r // queries``, query ``r % queries``) over the ``length`` tokens of
    pages ``page_ids``; ``visible [queries, logical]`` is the row's mask (``logical`` 0: causal
    by ``query_positions``)."""
    rows, dim = grouped.shape
    queries = visible.shape[0]
    page_size = positions.shape[1]
    value_dim = out.shape[1]
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
    for j in range((length + page_size - 1) // page_size):
        page = page_ids[j]
        filled = min(page_size, length - j * page_size)
        if not _seen_into(seen, positions, page, filled, visible, query_positions):
            continue
        load_keys(keys, page, key_page, key_bits, filled)
        load_values(values, page, value_page, value_bits, filled)
        for r in range(rows):
            q = r % queries
            page_max = _scores_into(scores, grouped, r, key_page, filled, seen[q], scale, softcap)
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
            _exp_into(scores, weights, weight_bits, filled)
            t = 0
            while t + 4 <= filled:
                w0, w1, w2, w3 = weights[t], weights[t + 1], weights[t + 2], weights[t + 3]
                running_sum[r] += w0 + w1 + w2 + w3
                for c in range(value_dim):  # four tokens per pass over the accumulator
                    acc[r, c] += (
                        w0 * value_page[t, c] + w1 * value_page[t + 1, c] + w2 * value_page[t + 2, c] + w3 * value_page[t + 3, c]
                    )
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


@numba.njit(parallel=True)  # no cache=True: loaders are arguments, and numba's on-disk index keys them by
def _paged_attention_kernel(  # dispatcher identity: never a hit in another process, and unsaveable (ReferenceError)
    query, keys, values, positions, pages, lengths, visible, query_positions, load_keys, load_values, scale, softcap, out
):  # pragma: no cover - compiled
    batch, heads, rows, dim = query.shape
    for pair in numba.prange(batch * heads):
        b = pair // heads
        h = pair % heads
        _attend_pair(
            query[b, h], keys, values, positions, pages[b, h], lengths[b, h], visible[b],
            query_positions, load_keys, load_values, scale, softcap, out[b, h],
        )


@numba.njit(fastmath=FASTMATH)  # no cache=True: see _paged_attention_kernel
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
        if not _seen_into(seen, positions, page, filled, visible, query_positions):
            continue
        load_keys(keys, page, key_page, key_bits, filled)
        for r in range(rows):
            _scores_into(scores, grouped, r, key_page, filled, seen[r % queries], scale, softcap)
            for t in range(filled):
                out[r, j * page_size + t] = scores[t]


@numba.njit(parallel=True)  # no cache=True: see _paged_attention_kernel
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


_LOADERS = {torch.float32: _load_float32, torch.float16: _load_float16, torch.bfloat16: _load_bfloat16}
"""Each page dtype's loader; the kernel is compiled once per pair of loaders (and argument types)."""


class PageSource(NamedTuple):
    """A layer's pages as the kernel reads them, in place (CPU): for keys and for values a numba
    argument (an array, or a tuple of arrays and ints: a codec's fields) and the loader that writes
    the first ``rows`` tokens of one of its pages as float32 (``load(source, page, out, out_bits,
    rows)``, as :func:`_load_float32`: ``out [page_size, dim]``, ``out_bits`` the same scratch
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
    load = _LOADERS[key_arena.dtype]
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
        Every tensor must be on the CPU (CUDA: :func:`kvlib.paged_attention_torch.attend_pages_torch`,
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
    grouped, mask, steps = _kernel_queries(query, pages, visible, query_positions)
    batch, query_heads, queries, _ = query.shape
    out = torch.empty(*grouped.shape[:3], source.value_dim, dtype=torch.float32)
    _paged_attention_kernel(
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
    )
    return out.view(batch, query_heads, queries, -1).to(query.dtype)


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
    :func:`attend_pages`'s."""
    grouped, mask, steps = _kernel_queries(query, pages, visible, query_positions)
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


def _kernel_queries(
    query: torch.Tensor, pages: torch.Tensor, visible: torch.Tensor | None, query_positions: torch.Tensor | None
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The kernels' query arguments: float32 queries grouped by KV head ``[batch, kv_heads, group
    * queries, head_dim]`` (row ``g * queries + q`` is query ``q`` of the group's ``g``-th head),
    the mask (no columns for causal) and the causal positions (empty with a mask)."""
    batch, query_heads, queries, dim = query.shape
    kv_heads = pages.shape[1]
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of KV heads ({kv_heads})")
    if visible is None and query_positions is None:
        raise ValueError("paged_attention needs the model's mask (visible) or the queries' positions")
    group = query_heads // kv_heads
    grouped = query.detach().reshape(batch, kv_heads, group * queries, dim).to(torch.float32).contiguous()
    mask = np.zeros((batch, queries, 0), dtype=np.bool_) if visible is None else visible.cpu().contiguous().numpy()
    steps = np.zeros(0, dtype=np.int64) if query_positions is None else query_positions.cpu().contiguous().numpy()
    return grouped, mask, steps


class PageReader(Protocol):
    """A layer's pages as some paged kernel reads them in place: :class:`PageSource` (the CPU
    kernel here) or :class:`~kvlib.paged_attention_torch.TorchPageSource` (torch ops, any device),
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
