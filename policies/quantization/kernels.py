"""Fused CPU kernels (numba) for the group quantizers: a min/max pass and a quantize-and-pack pass
to encode; one gather-unpack-dequantize-scatter pass to decode, over pages in parallel. The torch
code in :mod:`~kvlib.policies.quantization.uniform` is the reference (and the path on other
devices); ``tests/policies/quantization/test_kernels.py`` checks that both agree.

Pages are float32 ``[n, page_size * dim]`` (token-major). Codes are packed in that same element
order, little end first, ``8 // bits`` per byte or 8 per 3 bytes at 3 bits (as
:mod:`kvlib.kernels.packing` packs them). The
group of element ``i`` (token ``t = i // dim``, channel ``c = i % dim``) is:

- ``rows`` (values, per token): ``i // group`` (``group`` consecutive channels of a token);
- ``cols`` (keys, per channel): ``c`` (one channel across the page's tokens).

Kernels are built per bit width (a closure constant), so shifts and masks are constants.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np

from kvlib.kernels.packing import packed_code, unit_codes


@numba.njit(parallel=True, cache=True)
def min_max_rows(x: np.ndarray, group: int, low: np.ndarray, high: np.ndarray) -> None:
    """``low``/``high`` ``[n, groups]``: extremes of each run of ``group`` elements of ``x [n, count]``."""
    n, count = x.shape
    for p in numba.prange(n):
        for g in range(count // group):
            lo = x[p, g * group]
            hi = lo
            for k in range(1, group):
                v = x[p, g * group + k]
                lo = min(lo, v)
                hi = max(hi, v)
            low[p, g] = lo
            high[p, g] = hi


@numba.njit(parallel=True, cache=True)
def min_max_cols(x: np.ndarray, dim: int, low: np.ndarray, high: np.ndarray) -> None:
    """``low``/``high`` ``[n, dim]``: extremes of each channel of ``x [n, tokens * dim]`` over its tokens."""
    n, count = x.shape
    for p in numba.prange(n):
        for c in range(dim):
            low[p, c] = x[p, c]
            high[p, c] = x[p, c]
        for t in range(1, count // dim):
            for c in range(dim):
                v = x[p, t * dim + c]
                low[p, c] = min(low[p, c], v)
                high[p, c] = max(high[p, c], v)


@functools.cache
def quantize_pack(bits: int, cols: bool) -> Callable[..., None]:
    """Kernel ``(x, scale, minimum, dim, out)``: codes ``rint((x - minimum) * (1 / scale))``
    clamped to ``[0, 2**bits)`` (0 where ``scale == 0``), packed into ``out`` uint8 ``[n, bytes]``."""
    per_unit = unit_codes(bits)
    levels = np.float32((1 << bits) - 1)
    zero = np.float32(0.0)
    one = np.float32(1.0)

    @numba.njit(parallel=True, cache=True)
    def kernel(x: np.ndarray, scale: np.ndarray, minimum: np.ndarray, dim: int, out: np.ndarray) -> None:
        n, count = x.shape
        groups = scale.shape[1]
        group = count // groups
        codes = np.empty((n, count), dtype=np.uint8)
        for p in numba.prange(n):
            inverse = np.empty(groups, dtype=np.float32)
            for g in range(groups):
                inverse[g] = one / scale[p, g] if scale[p, g] > zero else zero
            if cols:
                for t in range(count // dim):
                    for c in range(dim):
                        q = np.rint((x[p, t * dim + c] - minimum[p, c]) * inverse[c])
                        codes[p, t * dim + c] = np.uint8(min(max(q, zero), levels))
            else:
                for g in range(groups):
                    m = minimum[p, g]
                    v = inverse[g]
                    for k in range(group):
                        q = np.rint((x[p, g * group + k] - m) * v)
                        codes[p, g * group + k] = np.uint8(min(max(q, zero), levels))
            if bits == 3:  # 8 codes in a 24-bit little-endian word, 3 bytes
                for j in range(count // per_unit):
                    word = np.int32(0)
                    for k in range(per_unit):
                        word |= np.int32(codes[p, j * per_unit + k]) << (3 * k)
                    out[p, 3 * j] = np.uint8(word & 255)
                    out[p, 3 * j + 1] = np.uint8((word >> 8) & 255)
                    out[p, 3 * j + 2] = np.uint8(word >> 16)
            else:
                for j in range(count // per_unit):
                    acc = codes[p, j * per_unit]
                    for k in range(1, per_unit):
                        acc |= codes[p, j * per_unit + k] << (bits * k)
                    out[p, j] = acc

    return kernel


@functools.cache
def unpack_dequantize(bits: int, cols: bool) -> Callable[..., None]:
    """Kernel ``(packed, sources, scale, minimum, out, targets)``: for each ``p``, row
    ``out[targets[p]]`` (float32 ``[count]``) becomes ``minimum + scale * code`` of the codes in
    ``packed[sources[p]]``; ``scale``/``minimum`` ``[len(sources), groups]`` float32."""
    shift = code_shift(bits)

    @numba.njit(parallel=True, fastmath=True, cache=True)
    def kernel(
        packed: np.ndarray, sources: np.ndarray, scale: np.ndarray, minimum: np.ndarray, out: np.ndarray, targets: np.ndarray
    ) -> None:
        count = out.shape[1]
        groups = scale.shape[1]
        for p in numba.prange(sources.shape[0]):
            src = sources[p]
            dst = targets[p]
            if cols:
                for t in range(count // groups):
                    for c in range(groups):
                        i = t * groups + c
                        out[dst, i] = dequantize(packed_code(packed, src, i, bits, shift), scale[p, c], minimum[p, c])
            else:
                group = count // groups
                for g in range(groups):
                    s = scale[p, g]
                    m = minimum[p, g]
                    for k in range(group):
                        i = g * group + k
                        out[dst, i] = dequantize(packed_code(packed, src, i, bits, shift), s, m)

    return kernel


@numba.njit(inline="always")
def dequantize(code: int, scale: np.float32, minimum: np.float32) -> np.float32:
    """The value of group code ``code``: ``minimum + scale * code`` (the decode of every group
    quantizer, here and in the paged-attention loaders)."""
    return minimum + scale * np.float32(code)


@numba.njit(inline="always")
def lookup(table: np.ndarray, code: int, scale: np.float32) -> np.float32:
    """The value of one-byte code ``code`` through a 256-entry ``table``: ``table[code] * scale``
    (int8 and fp8 decode, here and in the paged-attention loaders)."""
    return table[code] * scale


def code_shift(bits: int) -> int:
    """``log2(8 // bits)``: codes per byte as a shift (:func:`~kvlib.kernels.packing.packed_code`;
    unused at 3 bits, whose codes straddle bytes)."""
    return (8 // bits).bit_length() - 1


def fits(bits: int, count: int) -> bool:
    """Whether the kernels serve pages of ``count`` elements at ``bits`` (whole packing units per page)."""
    return count % unit_codes(bits) == 0


@numba.njit(parallel=True, fastmath=True, cache=True)
def scaled_lookup(
    codes: np.ndarray, sources: np.ndarray, table: np.ndarray, scale: np.ndarray, out: np.ndarray, targets: np.ndarray
) -> None:
    """``out[targets[p], i] = table[codes[sources[p], i]] * scale[p, i // (count // scale.shape[1])]``:
    decoding of one-byte codes through a 256-entry table (fp8 bit patterns to float32) with
    ``scale.shape[1]`` scales per row (one per page, or one per token)."""
    count = out.shape[1]
    run = count // scale.shape[1]
    for p in numba.prange(sources.shape[0]):
        src = sources[p]
        dst = targets[p]
        for g in range(scale.shape[1]):
            s = scale[p, g]
            for k in range(run):
                out[dst, g * run + k] = lookup(table, codes[src, g * run + k], s)


@numba.njit(parallel=True, cache=True)
def row_absmax(x: np.ndarray, out: np.ndarray) -> None:
    """``out[r] = max |x[r]|`` for ``x`` float32 ``[rows, dim]``."""
    for r in numba.prange(x.shape[0]):
        m = np.float32(0.0)
        for c in range(x.shape[1]):
            m = max(m, abs(x[r, c]))
        out[r] = m


@numba.njit(parallel=True, cache=True)
def quantize_symmetric(x: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """``out[r, c] = rint(x[r, c] * (1 / scale[r]))`` clamped to ``[-127, 127]`` (0 where ``scale[r] == 0``), int8."""
    limit = np.float32(127.0)
    for r in numba.prange(x.shape[0]):
        inverse = np.float32(1.0) / scale[r] if scale[r] > 0 else np.float32(0.0)
        for c in range(x.shape[1]):
            out[r, c] = np.int8(min(max(np.rint(x[r, c] * inverse), -limit), limit))
