"""What the CPU paged kernels share: page loaders, the vectorized ``exp``, the visibility and score
loops of one page, and the queries' layout (:mod:`kvlib.kernels.paged_attention` attends with them,
:mod:`kvlib.kernels.paged_scores` scores with them, :mod:`kvlib.kernels.coded_page_loaders` decodes half floats
with :func:`half_to_float`).

A *loader* writes the first ``rows`` tokens of one page as float32: ``load(source, page, out,
out_bits, rows)`` with ``out [page_size, dim]`` and ``out_bits`` the same scratch viewed as
uint32; float16 and bfloat16 pages are read as their bits (numba's CPU target cannot load them
directly).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvlib.kernels.query_groups import grouped_rows

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Page dtypes the kernel reads."""


@numba.njit(inline="always")
def half_to_float(bits: np.uint16) -> np.float32:
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
def load_float32(arena, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """``out[:rows] = arena[page, :rows]`` (float32 pages)."""
    for t in range(rows):
        for c in range(out.shape[1]):
            out[t, c] = arena[page, t, c]


@numba.njit(inline="always")
def load_float16(arena, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """``out[:rows] = arena[page, :rows]`` as float32 (float16 pages, given as their bits)."""
    for t in range(rows):
        for c in range(out.shape[1]):
            out[t, c] = half_to_float(arena[page, t, c])


@numba.njit(inline="always")
def load_bfloat16(arena, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
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


@numba.njit(inline="always", fastmath=FASTMATH)
def scores_into(scores, grouped, r, key_page, filled, seen, scale, softcap):  # pragma: no cover - compiled
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


LOADERS = {torch.float32: load_float32, torch.float16: load_float16, torch.bfloat16: load_bfloat16}
"""Each page dtype's loader; the kernel is compiled once per pair of loaders (and argument types)."""


def kernel_queries(
    query: torch.Tensor, pages: torch.Tensor, visible: torch.Tensor | None, query_positions: torch.Tensor | None
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The kernels' query arguments: float32 queries grouped by KV head ``[batch, kv_heads, group
    * queries, head_dim]`` (row ``g * queries + q`` is query ``q`` of the group's ``g``-th head),
    the mask (no columns for causal) and the causal positions (empty with a mask)."""
    batch, _, queries, dim = query.shape
    rows = grouped_rows(query, pages, visible, query_positions)
    grouped = query.detach().reshape(batch, pages.shape[1], rows, dim).to(torch.float32).contiguous()
    mask = np.zeros((batch, queries, 0), dtype=np.bool_) if visible is None else visible.cpu().contiguous().numpy()
    steps = np.zeros(0, dtype=np.int64) if query_positions is None else query_positions.cpu().contiguous().numpy()
    return grouped, mask, steps
