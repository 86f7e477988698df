"""What the CPU paged kernels share: float bit patterns, the vectorized ``exp``, visibility, and
the two inner loops every page goes through (:mod:`kvlib.kernels.paged_attention` attends with
them, :mod:`kvlib.kernels.paged_scores` scores with them, the codecs' readers of
:mod:`kvlib.kernels.page_readers` reuse them on decoded or folded pages).

Layout: a (row, KV head)'s query rows are a float32 ``[rows, head_dim]`` array, row ``g *
queries + q`` being query ``q`` of the group's ``g``-th head (:mod:`kvlib.kernels.query_groups`),
padded with zero rows to :func:`padded_rows` so that the inner loops take four rows per pass; a
page is a float32 ``[page_size, dim]`` array (an arena's page where it lies, or scratch a reader
decoded it into); scores and weights are ``[rows, page_size]``.

Float16 and bfloat16 arrive as their bit patterns (numba's CPU target has no arithmetic for
them) and are widened by :func:`float_of`, branch-free so that loops over them vectorize.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from kvlib.kernels.host_arrays import FLOAT_KINDS

SUPPORTED_DTYPES = tuple(FLOAT_KINDS)
"""Page dtypes the kernel reads (those :func:`float_of` widens)."""

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
"""LLVM's fast-math flags the kernels allow: reordered sums (so inner products and value sums
vectorize), fused multiply-adds; not ``nnan``/``ninf``, since masked scores are ``-inf``."""

LOG2E = np.float32(1.4426950408889634)
LN2_HIGH = np.float32(0.693359375)
LN2_LOW = np.float32(-2.12194440e-4)
EXP_FLOOR = np.float32(-87.0)
"""Below this exp underflows float32's normal range; such scores (and ``-inf``) weigh 0."""


@numba.njit(inline="always")
def float_of(bits, kind: int) -> np.float32:  # pragma: no cover - compiled
    """The float32 value of one float32, float16 or bfloat16 element (``kind``: :data:`~kvlib.kernels.host_arrays.FLOAT_KINDS`;
    16-bit floats as uint16 bits), exactly (subnormals, infinities and NaN included). A float16 is
    widened branch-free and without float32 subnormal arithmetic (which costs a microcode assist
    per operation on x86): a normal one by moving its bits and rebiasing the exponent, a
    subnormal one as its mantissa times ``2**-24`` (an int converted, then an exact product),
    infinities and NaN by their exponent."""
    if kind == 1:
        x = np.uint32(bits)
        magnitude = (x & np.uint32(0x7FFF)) << np.uint32(13)
        exponent = x & np.uint32(0x7C00)
        normal = np.uint32(magnitude + np.uint32(112 << 23))
        tiny = np.float32(np.float32(x & np.uint32(0x3FF)) * np.float32(5.960464477539063e-08))
        subnormal = np.uint32(tiny.view(np.uint32))
        special = np.uint32(magnitude | np.uint32(0x7F800000))
        finite = subnormal if exponent == np.uint32(0) else normal
        widened = special if exponent == np.uint32(0x7C00) else finite
        return np.uint32(widened | ((x & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)
    if kind == 2:
        return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)
    return np.float32(bits)


@numba.njit(inline="always", fastmath=FASTMATH)
def exp_into(x, out, bits, count):  # pragma: no cover - compiled
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
def seen_into(seen, positions, page, filled, visible, query_positions) -> bool:  # pragma: no cover - compiled
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


@numba.njit(fastmath=FASTMATH)
def float_scores(query, page, filled, scores) -> None:  # pragma: no cover - compiled
    """``scores[r, t] = query[r] . page[t]`` for every query row and the first ``filled`` tokens
    (float32). Four rows per pass over a token, so each key is loaded once for them (rows past the
    last whole four one at a time)."""
    rows, dim = query.shape
    for t in range(filled):
        r = 0
        while r + 4 <= rows:
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for c in range(dim):
                x = page[t, c]
                s0 += query[r, c] * x
                s1 += query[r + 1, c] * x
                s2 += query[r + 2, c] * x
                s3 += query[r + 3, c] * x
            scores[r, t] = s0
            scores[r + 1, t] = s1
            scores[r + 2, t] = s2
            scores[r + 3, t] = s3
            r += 4
        while r < rows:
            s = np.float32(0.0)
            for c in range(dim):
                s += query[r, c] * page[t, c]
            scores[r, t] = s
            r += 1


@numba.njit(fastmath=FASTMATH)
def float_accumulate(weights, page, filled, acc) -> None:  # pragma: no cover - compiled
    """``acc[r, :dim] += sum_t weights[r, t] * page[t]`` over the first ``filled`` tokens of
    ``page [page_size, dim]`` (float32). Four tokens and four rows per pass over the
    accumulator; nothing past ``filled`` is read (an arena's unwritten rows may hold any bits)."""
    rows = acc.shape[0]
    dim = page.shape[1]
    t = 0
    while t + 4 <= filled:
        r = 0
        while r + 4 <= rows:
            a0, a1, a2, a3 = weights[r, t], weights[r, t + 1], weights[r, t + 2], weights[r, t + 3]
            b0, b1, b2, b3 = weights[r + 1, t], weights[r + 1, t + 1], weights[r + 1, t + 2], weights[r + 1, t + 3]
            c0, c1, c2, c3 = weights[r + 2, t], weights[r + 2, t + 1], weights[r + 2, t + 2], weights[r + 2, t + 3]
            d0, d1, d2, d3 = weights[r + 3, t], weights[r + 3, t + 1], weights[r + 3, t + 2], weights[r + 3, t + 3]
            for c in range(dim):
                v0, v1, v2, v3 = page[t, c], page[t + 1, c], page[t + 2, c], page[t + 3, c]
                acc[r, c] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
                acc[r + 1, c] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3
                acc[r + 2, c] += c0 * v0 + c1 * v1 + c2 * v2 + c3 * v3
                acc[r + 3, c] += d0 * v0 + d1 * v1 + d2 * v2 + d3 * v3
            r += 4
        while r < rows:
            a0, a1, a2, a3 = weights[r, t], weights[r, t + 1], weights[r, t + 2], weights[r, t + 3]
            for c in range(dim):
                acc[r, c] += a0 * page[t, c] + a1 * page[t + 1, c] + a2 * page[t + 2, c] + a3 * page[t + 3, c]
            r += 1
        t += 4
    while t < filled:
        for r in range(rows):
            w = weights[r, t]
            for c in range(dim):
                acc[r, c] += w * page[t, c]
        t += 1


@numba.njit(inline="always")
def float32_page(raw, row, filled, kind, scratch):  # pragma: no cover - compiled
    """Page ``row`` of a float32 arena, where it lies (``kind`` and ``scratch`` unused)."""
    return raw[row]


@numba.njit(inline="always")
def bits_page(raw, row, filled, kind, scratch):  # pragma: no cover - compiled
    """Page ``row`` of a float16 or bfloat16 arena (uint16 bits, ``kind``), its first ``filled``
    tokens widened into ``scratch [page_size, dim]`` (returned)."""
    dim = scratch.shape[1]
    for t in range(filled):
        for c in range(dim):
            scratch[t, c] = float_of(raw[row, t, c], kind)
    return scratch


RAW_PAGES = {np.dtype(np.float32): float32_page, np.dtype(np.uint16): bits_page}
"""How a raw arena's page is read, by the numpy dtype of its host array."""


def padded_rows(rows: int) -> int:
    """Query rows the inner loops take for ``rows`` real ones: a multiple of four from three up
    (a fourth of the products wasted at most), one or two as they are."""
    return rows if rows < 3 else (rows + 3) // 4 * 4


@numba.njit(inline="always")
def gather_query(query, kind, b, h, group, queries, out) -> None:  # pragma: no cover - compiled
    """``out[g * queries + q] = query[b, h * group + g, q]`` as float32 (``query [batch,
    query_heads, queries, head_dim]``, float32 or uint16 bits of ``kind``); padding rows zero."""
    rows = group * queries
    dim = out.shape[1]
    for g in range(group):
        for q in range(queries):
            for c in range(dim):
                out[g * queries + q, c] = float_of(query[b, h * group + g, q, c], kind)
    for r in range(rows, out.shape[0]):
        for c in range(dim):
            out[r, c] = np.float32(0.0)


@numba.njit(inline="always", fastmath=FASTMATH)
def softmax_page(
    scores, rows, queries, filled, seen, scale, softcap, running_max, running_sum, acc, state, weights, bits
):  # pragma: no cover
    """One page's step of the online softmax (FlashAttention's rescaling) for the first ``rows``
    rows of ``scores [padded rows, page_size]`` (``q . k`` of the first ``filled`` tokens): times
    ``scale``, soft-capped when ``softcap > 0``, ``-inf`` where ``seen [queries, page_size]`` says
    the row's query does not see the token; each row's running max moves up to the page's, its
    sum, accumulator ``acc`` and codec state ``state`` rescaled when it does; ``weights`` gets
    ``exp(score - running max)`` (0 past ``filled``, for padding rows and rows that saw nothing
    of the page) and each row's sum grows by them. ``weights`` holds twice ``scores``' elements
    (the second half scratch of :func:`exp_into`; ``bits`` is it viewed as int32). Returns
    whether any row saw a token of the page."""
    padded, page_size = scores.shape
    any_row = False
    for r in range(padded):
        q = r % queries
        page_max = np.float32(-np.inf)
        if r < rows:
            for t in range(filled):
                s = scores[r, t] * scale
                if softcap > 0:
                    s = softcap * np.float32(math.tanh(s / softcap))
                s = s if seen[q, t] else np.float32(-np.inf)
                scores[r, t] = s
                page_max = max(page_max, s)
        if page_max == -np.inf:
            for t in range(page_size):
                scores[r, t] = np.float32(-np.inf)
            continue
        any_row = True
        if page_max > running_max[r]:
            if running_max[r] > -np.inf:
                rescale = np.float32(math.exp(running_max[r] - page_max))
                running_sum[r] *= rescale
                for c in range(acc.shape[1]):
                    acc[r, c] *= rescale
                for c in range(state.shape[1]):
                    state[r, c] *= rescale
            running_max[r] = page_max
        shift = running_max[r]
        for t in range(filled):
            scores[r, t] -= shift
        for t in range(filled, page_size):
            scores[r, t] = np.float32(-np.inf)
    count = padded * page_size
    exp_into(scores.reshape(count), weights, bits, count)
    for r in range(rows):
        total = np.float32(0.0)
        for t in range(filled):
            total += weights[r * page_size + t]
        running_sum[r] += total
    return any_row
