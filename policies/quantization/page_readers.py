"""The quantization codecs' numba page readers: sealed pages read inside the paged-attention kernel,
scales folded in where the layout allows (the reader contract: :mod:`kvlib.kernels.page_readers`).

- ``"group"`` (:class:`~.uniform.GroupQuantizer`: kivi, kv_bits, rotated's inner codes): a page's
  codes are unpacked once into float32 scratch (a flat pass per bit width, vectorized), then

  - keys per channel (KIVI's): ``q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c m_c``: the query
    rows are scaled by the page's channel scales (``rows * dim`` products a page, not
    ``page_size * dim``) and the minima's part is one product per row, added to the token's score;
  - keys per token, one group a token: ``q . k_t = s_t (q . code_t) + m_t sum_c q_c``;
  - values per token (and keys per token in several groups): each token's groups are
    dequantized in the scratch (``m + s * code``; 4-bit codes unpacked in the same pass) and
    summed by the float loops, four tokens and four rows a pass. Folding these scales into the
    weights instead (``sum_t (w_t s_t) code_t + sum_t w_t m_t``) measured slower on the CPU
    (0.88 ms against 0.74 ms for 1536 4-bit pages in groups of 32, four rows): a group's scale
    changes every ``group`` channels, which the accumulator pass then has to follow per row;

- ``"scaled_bytes"`` (:class:`~.uniform.AbsmaxInt8`, :class:`~.fp8.PageScaledFP8`): one-byte
  codes (int8, or float8 e4m3 widened from its bits) times a scale per run of elements: keys
  ``q . k_t = s_t (q . code_t)`` (the scale multiplies the score), values scaled as they are widened;
- ``"gear"`` (:class:`~.gear_codec.GearQuantizer`): a page decoded into scratch by
  :func:`load_gear` (codes, then ``U V^T``, then outliers), then the float loops;
- ``"qaq"`` (:class:`~.qaq.TokenAdaptiveQuantizer`): a page decoded into scratch by
  :func:`load_qaq` (each token's codes at its own bits, from where the earlier tokens' end, then
  its exact outliers), then the float loops.

Each reads what the codec's float32 decode gives (:meth:`~kvlib.codec.TensorCodec.decode_into`
into float32), up to float32 rounding of the reordered sums (never rounded to the compute
dtype). Metadata (scales, minima) stays in its stored dtype and is widened by
:func:`~kvlib.kernels.page_kernel_parts.float_of`. Parameters are runtime ints in the fields, so
one compilation of the kernel serves every bit width (each width a branch with constant shifts).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvlib.kernels.host_arrays import FLOAT_KINDS, host_array
from kvlib.kernels.packing import packed_code
from kvlib.kernels.page_kernel_parts import FASTMATH, float_accumulate, float_of, float_scores
from kvlib.kernels.page_readers import NumbaReader, loader_reader, no_state, no_work, nothing_to_finish, register_numba_reader

# -- group quantizers ------------------------------------------------------------------------


def group_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """``(codes uint8 [capacity, bytes], scale, minimum [capacity, groups] as bits, meta kind,
    bits, per_channel, group)`` of a group quantizer's reader: its fields ``(codes, scale,
    minimum)`` and params ``(bits, per_channel, group)`` as numpy views."""
    codes, scale, minimum = tensors
    bits, per_channel, group = params
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"group-quantized pages are read at 2, 3, 4 or 8 bits, got {bits}")
    return (_rows(codes), _rows(scale), _rows(minimum), FLOAT_KINDS[scale.dtype], bits, per_channel, group)


def _rows(arena: torch.Tensor) -> np.ndarray:
    """A field arena as a numpy ``[capacity, elements per page]`` view (no torch operator)."""
    array = host_array(arena)
    return array.reshape(array.shape[0], math.prod(array.shape[1:]))


@numba.njit(inline="always", fastmath=FASTMATH)
def nibbles(byte) -> tuple[np.float32, np.float32]:  # pragma: no cover - compiled
    """The low and high 4-bit codes of a uint8 as float32, in float arithmetic (exact: a byte is
    an integer below 2**8, ``/ 16`` a power of two): numba widens integer arithmetic to int64,
    whose conversions to float32 vectorize at half the width of float32 lanes."""
    value = np.float32(byte)
    high = np.floor(value * np.float32(0.0625))
    return value - np.float32(16.0) * high, high


@numba.njit(fastmath=FASTMATH)
def unpack_codes(codes, page, bits, count, out) -> None:  # pragma: no cover - compiled
    """The first ``count`` codes of ``page`` (``codes`` uint8 ``[capacity, bytes]``,
    :func:`~kvlib.kernels.packing.pack`'s layout) as float32 into flat ``out``: one pass over the
    whole bytes per bit width, so each vectorizes (3-bit codes, which straddle bytes, and codes
    past the last whole byte one by one). Nothing past ``out[count - 1]`` is written."""
    if bits == 8:
        for i in range(count):
            out[i] = np.float32(codes[page, i])
        return
    if bits == 4:
        whole = count // 2
        source = codes[page, :whole]  # a view, indexed from 0: the loop vectorizes
        for i in range(whole):
            low, high = nibbles(source[i])
            out[2 * i] = low
            out[2 * i + 1] = high
    elif bits == 2:
        whole = count // 4
        for i in range(whole):
            byte = np.int32(codes[page, i])
            out[4 * i] = np.float32(byte & 3)
            out[4 * i + 1] = np.float32((byte >> 2) & 3)
            out[4 * i + 2] = np.float32((byte >> 4) & 3)
            out[4 * i + 3] = np.float32(byte >> 6)
    else:
        whole = 0
    done = whole * (8 // bits) if bits != 3 else 0
    shift = 1 if bits == 4 else (2 if bits == 2 else 0)
    for i in range(done, count):  # codes past the last whole byte; every 3-bit code
        out[i] = np.float32(packed_code(codes, page, i, bits, shift))


@numba.njit(fastmath=FASTMATH)
def dequantize_tokens(page_codes, scale, minimum, kind, page, filled, group) -> None:  # pragma: no cover - compiled
    """``page_codes [page_size, dim]`` (float32 codes) becomes ``minimum + scale * code`` of each
    token's groups of ``group`` channels (group ``t * (dim // group) + c // group`` of the page's
    scales and minima), for its first ``filled`` tokens."""
    dim = page_codes.shape[1]
    groups = dim // group
    for t in range(filled):
        for g in range(groups):
            s = float_of(scale[page, t * groups + g], kind)
            m = float_of(minimum[page, t * groups + g], kind)
            run = page_codes[t, g * group : (g + 1) * group]  # a view, indexed from 0: the loop vectorizes
            for k in range(group):
                run[k] = m + s * run[k]


@numba.njit(fastmath=FASTMATH)
def unpack_dequantize_nibbles(codes, page, scale, minimum, kind, filled, group, out) -> None:  # pragma: no cover - compiled
    """4-bit codes of ``page``'s first ``filled`` tokens in groups of ``group`` channels (even)
    straight to ``minimum + scale * code`` in ``out [page_size, dim]``: :func:`unpack_codes` and
    :func:`dequantize_tokens` in one pass over each group's bytes."""
    dim = out.shape[1]
    groups = dim // group
    half = group // 2
    for t in range(filled):
        for g in range(groups):
            s = float_of(scale[page, t * groups + g], kind)
            m = float_of(minimum[page, t * groups + g], kind)
            start = (t * dim + g * group) // 2
            source = codes[page, start : start + half]  # views, indexed from 0: the loop vectorizes
            target = out[t, g * group : (g + 1) * group]
            for k in range(half):
                low, high = nibbles(source[k])
                target[2 * k] = m + s * low
                target[2 * k + 1] = m + s * high


@numba.njit(fastmath=FASTMATH)
def dequantize_channels(page_codes, scale, minimum, kind, page, filled) -> None:  # pragma: no cover - compiled
    """``page_codes [page_size, dim]`` becomes ``minimum_c + scale_c * code`` per channel, first ``filled`` tokens."""
    dim = page_codes.shape[1]
    for t in range(filled):
        for c in range(dim):
            page_codes[t, c] = float_of(minimum[page, c], kind) + float_of(scale[page, c], kind) * page_codes[t, c]


@numba.njit
def group_work(fields, query, head):  # pragma: no cover - compiled
    """Rows ``[0, rows)``: the query scaled by a page's channel scales; then the scales and the minima."""
    return np.empty((query.shape[0] + 2, query.shape[1]), dtype=np.float32)


@numba.njit(fastmath=FASTMATH)
def group_key_scores(fields, page, head, query, work, filled, scores, scratch) -> None:  # pragma: no cover - compiled
    """Scores of a group quantizer's sealed keys (see the module docstring)."""
    codes, scale, minimum, kind, bits, per_channel, group = fields
    rows, dim = query.shape
    unpack_codes(codes, page, bits, filled * dim, scratch.reshape(scratch.size))
    if per_channel:
        scales, minima, scaled = work[rows], work[rows + 1], work[:rows]
        for c in range(dim):
            scales[c] = float_of(scale[page, c], kind)
            minima[c] = float_of(minimum[page, c], kind)
        for r in range(rows):
            for c in range(dim):
                scaled[r, c] = query[r, c] * scales[c]
        float_scores(scaled, scratch, filled, scores)
        for r in range(rows):
            offset = np.float32(0.0)
            for c in range(dim):
                offset += query[r, c] * minima[c]
            for t in range(filled):
                scores[r, t] += offset
    elif group == dim:
        float_scores(query, scratch, filled, scores)
        for r in range(rows):
            total = np.float32(0.0)
            for c in range(dim):
                total += query[r, c]
            for t in range(filled):
                scores[r, t] = float_of(scale[page, t], kind) * scores[r, t] + float_of(minimum[page, t], kind) * total
    else:
        dequantize_tokens(scratch, scale, minimum, kind, page, filled, group)
        float_scores(query, scratch, filled, scores)


@numba.njit(fastmath=FASTMATH)
def group_accumulate(fields, page, head, weights, filled, acc, state, scratch) -> None:  # pragma: no cover - compiled
    """A group quantizer's sealed values added into ``acc`` (dequantized in the scratch, see the module docstring)."""
    codes, scale, minimum, kind, bits, per_channel, group = fields
    if bits == 4 and not per_channel and group % 2 == 0:
        unpack_dequantize_nibbles(codes, page, scale, minimum, kind, filled, group, scratch)
    else:
        unpack_codes(codes, page, bits, filled * scratch.shape[1], scratch.reshape(scratch.size))
        if per_channel:
            dequantize_channels(scratch, scale, minimum, kind, page, filled)
        else:
            dequantize_tokens(scratch, scale, minimum, kind, page, filled, group)
    float_accumulate(weights, scratch, filled, acc)


GROUP = register_numba_reader(
    "group", NumbaReader(group_fields, group_work, group_key_scores, no_state, group_accumulate, nothing_to_finish)
)
"""The numba reader of :class:`~.uniform.GroupQuantizer` pages."""


# -- one byte per element and a scale per run ------------------------------------------------

INT8_CODES, E4M3_CODES = 0, 1
"""``scaled_bytes`` code kinds: signed bytes, or float8 e4m3 bit patterns."""


def scaled_bytes_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """``(codes uint8 [capacity, page elements], scale [capacity, runs] (float32 or bits), scale
    kind, code kind, run)`` of a one-byte codec's reader: fields ``(codes, scale)``, params
    ``(code kind, run)`` (elements per scale)."""
    codes, scale = tensors
    code_kind, run = params
    return (_rows(codes).view(np.uint8), _rows(scale), FLOAT_KINDS[scale.dtype], code_kind, run)


@numba.njit(inline="always")
def e4m3_value(byte) -> np.float32:  # pragma: no cover - compiled
    """float32 of a float8 e4m3fn bit pattern, branch-free: its exponent and mantissa bits moved
    into a float32 and scaled by ``2**120`` (exact for normals and subnormals), sign kept,
    ``0x7F``/``0xFF`` NaN."""
    bits = np.uint32(byte)
    magnitude = np.uint32(np.uint32(bits & np.uint32(0x7F)) << np.uint32(20)).view(np.float32) * np.float32(1.329227995784916e36)
    signed = np.uint32(np.float32(magnitude).view(np.uint32) | ((bits & np.uint32(0x80)) << np.uint32(24))).view(np.float32)
    return np.float32(np.nan) if (bits & np.uint32(0x7F)) == np.uint32(0x7F) else signed


@numba.njit(fastmath=FASTMATH)
def unpack_bytes(codes, page, code_kind, filled, out) -> None:  # pragma: no cover - compiled
    """The first ``filled`` tokens' one-byte codes of ``page`` as float32 into ``out [page_size, dim]``."""
    dim = out.shape[1]
    for t in range(filled):
        token = codes[page, t * dim : (t + 1) * dim]  # a view, indexed from 0: the loops vectorize
        row = out[t]
        if code_kind == INT8_CODES:
            for c in range(dim):
                row[c] = np.float32(np.int8(token[c]))
        else:
            for c in range(dim):
                row[c] = e4m3_value(token[c])


@numba.njit(fastmath=FASTMATH)
def scaled_bytes_key_scores(fields, page, head, query, work, filled, scores, scratch) -> None:  # pragma: no cover - compiled
    """Scores of one-byte keys: ``q . code_t`` times the token's scale."""
    codes, scale, scale_kind, code_kind, run = fields
    dim = scratch.shape[1]
    unpack_bytes(codes, page, code_kind, filled, scratch)
    float_scores(query, scratch, filled, scores)
    for t in range(filled):
        s = float_of(scale[page, t * dim // run], scale_kind)
        for r in range(query.shape[0]):
            scores[r, t] *= s


@numba.njit(fastmath=FASTMATH)
def scaled_bytes_accumulate(fields, page, head, weights, filled, acc, state, scratch) -> None:  # pragma: no cover - compiled
    """One-byte values, scaled as they are widened, added into ``acc``."""
    codes, scale, scale_kind, code_kind, run = fields
    dim = scratch.shape[1]
    unpack_bytes(codes, page, code_kind, filled, scratch)
    for t in range(filled):
        s = float_of(scale[page, t * dim // run], scale_kind)
        for c in range(dim):
            scratch[t, c] *= s
    float_accumulate(weights, scratch, filled, acc)


SCALED_BYTES = register_numba_reader(
    "scaled_bytes",
    NumbaReader(scaled_bytes_fields, no_work, scaled_bytes_key_scores, no_state, scaled_bytes_accumulate, nothing_to_finish),
)
"""The numba reader of :class:`~.uniform.ScaledBytes` pages (int8, fp8)."""


# -- GEAR ------------------------------------------------------------------------------------


def gear_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """:func:`group_fields` of the quantized codes, then ``(token_factors [capacity, page_size *
    rank], channel_factors [capacity, dim * rank] bits, rank, outlier_index [capacity, count],
    outlier_value [capacity, count] bits, count)``; fields ``(codes, scale, minimum,
    token_factors, channel_factors, outlier_index, outlier_value)`` (empty stand-ins where
    ``rank`` or ``count`` is 0), params ``(bits, per_channel, group, rank, count)``."""
    codes, scale, minimum, tokens, channels, index, value = tensors
    bits, per_channel, group, rank, count = params
    quantized = group_fields((codes, scale, minimum), (bits, per_channel, group))
    return (*quantized, _rows(tokens), _rows(channels), rank, _rows(index), _rows(value), count)


@numba.njit(fastmath=FASTMATH)
def decode_page_groups(codes, scale, minimum, kind, bits, per_channel, group, page, out, rows) -> None:  # pragma: no cover - compiled
    """The group codes of ``page``'s first ``rows`` tokens decoded into ``out [page_size, dim]``."""
    unpack_codes(codes, page, bits, rows * out.shape[1], out.reshape(out.size))
    if per_channel:
        dequantize_channels(out, scale, minimum, kind, page, rows)
    else:
        dequantize_tokens(out, scale, minimum, kind, page, rows, group)


@numba.njit
def load_gear(fields, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:  # pragma: no cover - compiled
    """A :class:`~.gear_codec.GearQuantizer`'s sealed page (``fields``: :func:`gear_fields`): the
    group codes, plus ``U V^T``, then the outliers written over."""
    codes, scale, minimum, kind, bits, per_channel, group, tokens, channels, rank, index, value, count = fields
    decode_page_groups(codes, scale, minimum, kind, bits, per_channel, group, page, out, rows)
    dim = out.shape[1]
    for t in range(rows):
        for c in range(dim):
            correction = np.float32(0.0)
            for k in range(rank):
                correction += float_of(tokens[page, t * rank + k], kind) * float_of(channels[page, c * rank + k], kind)
            out[t, c] += correction
    for j in range(count):
        element = np.int64(index[page, j])
        if element < rows * dim:
            out[element // dim, element % dim] = float_of(value[page, j], kind)


GEAR = register_numba_reader("gear", loader_reader(load_gear, gear_fields))
"""The numba reader of :class:`~.gear_codec.GearQuantizer` pages."""


# -- QAQ -------------------------------------------------------------------------------------


def qaq_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """``(codes uint8 [capacity, bytes], bits uint8 [capacity, page_size], scale, minimum
    [capacity, page_size] as bits, meta kind, outlier_index [capacity, page_size * 2 * count],
    outlier_value [capacity, page_size * 2 * count] as bits, 2 * count)`` of a
    :class:`~.qaq.TokenAdaptiveQuantizer`'s reader: fields ``(codes, bits, scale, minimum,
    outlier_index, outlier_value)`` (empty stand-ins for the outliers where ``count`` is 0),
    params ``(count,)``."""
    codes, bits, scale, minimum, index, value = tensors
    (count,) = params
    return (_rows(codes), _rows(bits), _rows(scale), _rows(minimum), FLOAT_KINDS[scale.dtype], _rows(index), _rows(value), 2 * count)


@numba.njit(inline="always", fastmath=FASTMATH)
def dequantize_token(
    codes, page: int, start: int, bits: int, low: np.float32, step: np.float32, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``out[c] = low + step * code_c`` for the ``len(out)`` codes of one token that begin at byte
    ``start`` of ``page``'s row of ``codes``, at ``bits`` bits (:func:`~kvlib.kernels.packing.pack`'s
    layout of that token's codes alone; ``len(out)`` a multiple of 8). One loop per width, its
    shifts constant, over whole bytes (whole 3-byte units at 3 bits)."""
    dim = out.shape[0]
    if bits == 8:
        for c in range(dim):
            out[c] = low + np.float32(codes[page, start + c]) * step
    elif bits == 4:
        for b in range(dim // 2):
            byte = np.int32(codes[page, start + b])
            out[2 * b] = low + np.float32(byte & 15) * step
            out[2 * b + 1] = low + np.float32(byte >> 4) * step
    elif bits == 2:
        for b in range(dim // 4):
            byte = np.int32(codes[page, start + b])
            for k in range(4):
                out[4 * b + k] = low + np.float32((byte >> (2 * k)) & 3) * step
    elif bits == 1:
        for b in range(dim // 8):
            byte = np.int32(codes[page, start + b])
            for k in range(8):
                out[8 * b + k] = low + np.float32((byte >> k) & 1) * step
    else:  # 3 bits: 8 codes in each 3-byte unit, code k at bits 3k of the unit's 24
        for u in range(dim // 8):
            unit = np.int32(codes[page, start + 3 * u]) | (np.int32(codes[page, start + 3 * u + 1]) << 8)
            unit |= np.int32(codes[page, start + 3 * u + 2]) << 16
            for k in range(8):
                out[8 * u + k] = low + np.float32((unit >> (3 * k)) & 7) * step


@numba.njit(fastmath=FASTMATH)
def load_qaq(fields, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:  # pragma: no cover - compiled
    """A :class:`~.qaq.TokenAdaptiveQuantizer`'s sealed page (``fields``: :func:`qaq_fields`): each
    of the first ``rows`` tokens dequantized at its own bits (``minimum + scale * code``), its
    codes starting where the earlier tokens' end, then its outliers written over."""
    codes, bits, scale, minimum, kind, index, value, pairs = fields
    dim = out.shape[1]
    start = 0
    for t in range(rows):
        width = np.int64(bits[page, t])
        dequantize_token(codes, page, start, width, float_of(minimum[page, t], kind), float_of(scale[page, t], kind), out[t])
        start += dim * width // 8
        for j in range(pairs):
            out[t, np.int64(index[page, t * pairs + j])] = float_of(value[page, t * pairs + j], kind)


QAQ = register_numba_reader("qaq", loader_reader(load_qaq, qaq_fields))
"""The numba reader of :class:`~.qaq.TokenAdaptiveQuantizer` pages."""
