"""Fused CPU kernels (numba) of GEAR's codec (:mod:`.gear_codec`): the outlier filter, the
low-rank fit of the residual and the decode's corrections, over pages in parallel. The torch code
in :mod:`.gear_codec` is the reference (and the path on other devices);
``tests/policies/quantization/test_gear.py`` checks that both agree.

Pages are float32 ``[n, page_size, dim]``. A page's quantization groups are (as
:class:`~.uniform.GroupQuantizer`'s): per channel, channel ``c`` across the page's tokens; per
token, runs of ``group`` channels of a token. Element positions are token-major
(``t * dim + c``), as the codec's ``outlier_index`` field stores them.
"""

from __future__ import annotations

import numba
import numpy as np

NEGATIVE_INFINITY = np.float32(-np.inf)


@numba.njit(inline="always")
def position(per_channel: bool, group: int, dim: int, g: int, k: int) -> int:
    """Token-major position of entry ``k`` of group ``g``."""
    if per_channel:
        return k * dim + g
    return g * group + k


@numba.njit(inline="always")
def removal_gains(ordered: np.ndarray, lo: int, hi: int) -> tuple[np.float32, np.float32]:
    """How much a group's squared range shrinks if its lowest (first) or highest (second)
    remaining entry goes: ``ordered`` its entries ascending, ``[lo, hi]`` the remaining ranks
    (``-inf`` both once one entry is left), in :func:`~.gear_codec.narrowing_outliers`' float32
    operations."""
    if hi <= lo:
        return NEGATIVE_INFINITY, NEGATIVE_INFINITY
    last = ordered.shape[0] - 1
    bottom = ordered[lo]
    top = ordered[hi]
    span = (top - bottom) * (top - bottom)
    above = ordered[min(lo + 1, last)]
    below = ordered[max(hi - 1, 0)]
    return span - (top - above) * (top - above), span - (below - bottom) * (below - bottom)


@numba.njit(parallel=True, cache=True)
def narrow_outliers(x: np.ndarray, per_channel: bool, group: int, count: int, clipped: np.ndarray, chosen: np.ndarray) -> None:
    """:func:`~.gear_codec.narrowing_outliers` on each page of ``x [n, page_size, dim]``: takes
    ``count`` entries out, each time the lowest or highest remaining entry of the group whose
    squared range it shrinks most (ties: the first group, its lowest entry first). Writes the
    page clamped to each group's remaining range into ``clipped`` (float32 ``[n, page_size *
    dim]``) and the taken entries' token-major positions into ``chosen`` (int64 ``[n, count]``)."""
    n, tokens, dim = x.shape
    size = tokens if per_channel else group
    groups = dim if per_channel else tokens * dim // group
    for p in numba.prange(n):
        flat = x[p].reshape(tokens * dim)
        ordered = np.empty((groups, size), dtype=np.float32)
        order = np.empty((groups, size), dtype=np.int64)
        for g in range(groups):  # insertion sort of each small group (stable: ties keep their order)
            for k in range(size):
                v = flat[position(per_channel, group, dim, g, k)]
                j = k
                while j > 0 and ordered[g, j - 1] > v:
                    ordered[g, j] = ordered[g, j - 1]
                    order[g, j] = order[g, j - 1]
                    j -= 1
                ordered[g, j] = v
                order[g, j] = k
        lo = np.zeros(groups, dtype=np.int64)
        hi = np.full(groups, size - 1, dtype=np.int64)
        gains = np.empty((groups, 2), dtype=np.float32)
        for g in range(groups):
            gains[g, 0], gains[g, 1] = removal_gains(ordered[g], lo[g], hi[g])
        for step in range(count):
            best_group, best_upper, best = 0, 0, NEGATIVE_INFINITY
            for g in range(groups):
                for upper in range(2):
                    if gains[g, upper] > best or (g == 0 and upper == 0):
                        best_group, best_upper, best = g, upper, gains[g, upper]
            g = best_group
            if best_upper:
                chosen[p, step] = position(per_channel, group, dim, g, order[g, hi[g]])
                hi[g] -= 1
            else:
                chosen[p, step] = position(per_channel, group, dim, g, order[g, lo[g]])
                lo[g] += 1
            gains[g, 0], gains[g, 1] = removal_gains(ordered[g], lo[g], hi[g])
        for g in range(groups):
            low = ordered[g, lo[g]]
            high = ordered[g, hi[g]]
            for k in range(size):
                i = position(per_channel, group, dim, g, k)
                clipped[p, i] = max(min(flat[i], high), low)


@numba.njit(inline="always")
def _project(matrix: np.ndarray, vectors: np.ndarray, k: int, out: np.ndarray) -> None:
    """Column ``k`` of ``out = matrix @ vectors`` (float32, each sum in index order)."""
    for i in range(matrix.shape[0]):
        acc = np.float32(0.0)
        for j in range(matrix.shape[1]):
            acc += matrix[i, j] * vectors[j, k]
        out[i, k] = acc


@numba.njit(parallel=True, cache=True)
def fit_low_rank(
    x: np.ndarray, decoded: np.ndarray, chosen: np.ndarray, iterations: int, tokens_out: np.ndarray, channels_out: np.ndarray
) -> None:
    """:func:`~.gear_codec.power_iteration` of each page's residual ``x - decoded`` (``x`` float32
    ``[n, page_size, dim]``, ``decoded`` float32 ``[n, page_size * dim]``) with the outliers at
    positions ``chosen [n, count]`` zeroed: ``U`` (``tokens_out [n, page_size, rank]``, orthonormal
    columns by modified Gram-Schmidt, 0 where the residual has no more rank) and ``V = R^T U``
    (``channels_out [n, dim, rank]``), started from the rows of largest norm."""
    n, rows, cols = x.shape
    rank = tokens_out.shape[2]
    for p in numba.prange(n):
        residual = np.empty((rows, cols), dtype=np.float32)
        for t in range(rows):
            for c in range(cols):
                residual[t, c] = x[p, t, c] - decoded[p, t * cols + c]
        for j in range(chosen.shape[1]):
            residual[chosen[p, j] // cols, chosen[p, j] % cols] = 0.0
        norms = np.zeros(rows, dtype=np.float32)
        for t in range(rows):
            for c in range(cols):
                norms[t] += residual[t, c] * residual[t, c]
        start = np.argsort(-norms, kind="mergesort")
        channels = np.empty((cols, rank), dtype=np.float32)
        for k in range(rank):
            for c in range(cols):
                channels[c, k] = residual[start[k], c]
        basis = np.zeros((rows, rank), dtype=np.float32)
        for _ in range(iterations):
            for k in range(rank):
                _project(residual, channels, k, basis)  # U = R V, column k
                for j in range(k):
                    dot = np.float32(0.0)
                    for t in range(rows):
                        dot += basis[t, j] * basis[t, k]
                    for t in range(rows):
                        basis[t, k] -= dot * basis[t, j]
                length = np.float32(0.0)
                for t in range(rows):
                    length += basis[t, k] * basis[t, k]
                inverse = np.float32(1.0) / np.sqrt(length) if length > 0 else np.float32(0.0)
                for t in range(rows):
                    basis[t, k] *= inverse
            for k in range(rank):
                _project(residual.T, basis, k, channels)  # V = R^T U, column k
        for t in range(rows):
            for k in range(rank):
                tokens_out[p, t, k] = basis[t, k]
        for c in range(cols):
            for k in range(rank):
                channels_out[p, c, k] = channels[c, k]


@numba.njit(parallel=True, cache=True)
def add_corrections(
    out: np.ndarray,
    targets: np.ndarray,
    tokens: np.ndarray,
    channels: np.ndarray,
    index: np.ndarray,
    value: np.ndarray,
) -> None:
    """Row ``out[targets[p]]`` (float32 ``[page_size * dim]``, the codes decoded) plus ``U V^T``
    of ``tokens [m, page_size, rank]`` and ``channels [m, dim, rank]`` (float32), then the
    outliers ``value [m, count]`` written at positions ``index [m, count]``: what the page
    loader :func:`~.page_loaders.load_gear` computes, in its order."""
    rows, rank = tokens.shape[1], tokens.shape[2]
    cols = channels.shape[1]
    for p in numba.prange(targets.shape[0]):
        dst = targets[p]
        if rank:
            for t in range(rows):
                for c in range(cols):
                    correction = np.float32(0.0)
                    for k in range(rank):
                        correction += tokens[p, t, k] * channels[p, c, k]
                    out[dst, t * cols + c] += correction
        for j in range(index.shape[1]):
            out[dst, index[p, j]] = value[p, j]
