"""The quantization codecs' page loaders: sealed pages decoded inside the paged-attention kernel.

Each loader is ``load(source, page, out, out_bits, rows)`` with ``source = open_part + fields``
(see :mod:`kvlib.kernels.coded_page_loaders`): an open page is read raw, a sealed page is decoded
token-major into ``out [page_size, dim]`` (float32) with the same element helpers as the
codecs' decode kernels (:func:`~kvlib.kernels.packing.packed_code`,
:func:`~.kernels.dequantize`, :func:`~.kernels.lookup`), so the kernel reads what
:meth:`~kvlib.codec.TensorCodec.decode` returns, in float32 (no rounding to the compute dtype).
Metadata (scales, minima) stays in its stored dtype and is read as bit patterns
(:func:`~kvlib.kernels.coded_page_loaders.float_of`). Parameters are runtime ints in ``fields``, so one
compilation of the kernel serves every bit width (each width a branch with constant shifts).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvlib.codec import CodedReader
from kvlib.kernels.coded_page_loaders import OPEN_ITEMS, float_bits, float_of, load_open
from kvlib.kernels.packing import packed_code
from kvlib.strategies.quantization.kernels import dequantize, lookup


@numba.njit(inline="always")
def load_group_quantized(source, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """A :class:`~.uniform.GroupQuantizer`'s page. ``fields = (codes uint8 [capacity, bytes],
    scale, minimum [capacity, groups] bits, meta kind, bits, per_channel, group)``: per channel
    (``per_channel == 1``) group ``c`` is channel ``c`` across the page's tokens, else group
    ``t * (dim // group) + c // group`` is a run of ``group`` channels of token ``t``."""
    if load_open(source, page, out, out_bits, rows):
        return
    codes, scale, minimum, kind, bits, per_channel, group = source[OPEN_ITEMS:]
    decode_page_groups(codes, scale, minimum, kind, bits, per_channel, group, page, out, rows)


@numba.njit(inline="always")
def decode_page_groups(
    codes, scale, minimum, kind: int, bits: int, per_channel: int, group: int, page: int, out: np.ndarray, rows: int
) -> None:
    """The group codes of ``page`` decoded into ``out``'s first ``rows`` rows (see
    :func:`load_group_quantized`). Each bit width is its own branch, so that its shifts and masks
    are constants in the loops."""
    if bits == 4:
        decode_groups(codes, scale, minimum, kind, 4, 1, per_channel, group, page, out, rows)
    elif bits == 2:
        decode_groups(codes, scale, minimum, kind, 2, 2, per_channel, group, page, out, rows)
    elif bits == 3:
        decode_groups(codes, scale, minimum, kind, 3, 0, per_channel, group, page, out, rows)
    else:
        decode_groups(codes, scale, minimum, kind, 8, 0, per_channel, group, page, out, rows)


@numba.njit(inline="always")
def decode_groups(
    codes, scale, minimum, kind: int, bits: int, shift: int, per_channel: int, group: int, page: int, out: np.ndarray, rows: int
) -> None:
    """The first ``rows`` tokens of sealed ``page`` at ``bits`` bits (``2**shift`` codes per byte;
    3-bit codes 8 per 3 bytes, ``shift`` unused)."""
    dim = out.shape[1]
    if per_channel:  # token-major, channels innermost over each channel's scale and minimum (vectorizes)
        s = np.empty(dim, dtype=np.float32)
        m = np.empty(dim, dtype=np.float32)
        for c in range(dim):
            s[c] = float_of(scale[page, c], kind)
            m[c] = float_of(minimum[page, c], kind)
        for t in range(rows):
            for c in range(dim):
                out[t, c] = dequantize(packed_code(codes, page, t * dim + c, bits, shift), s[c], m[c])
        return
    groups = dim // group
    for t in range(rows):
        for g in range(groups):
            s = float_of(scale[page, t * groups + g], kind)
            m = float_of(minimum[page, t * groups + g], kind)
            for k in range(group):
                c = g * group + k
                out[t, c] = dequantize(packed_code(codes, page, t * dim + c, bits, shift), s, m)


@numba.njit(inline="always")
def load_byte_table(source, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """One-byte codes through a 256-entry table times a scale per run of elements (int8: a scale
    per token; fp8: one per page). ``fields = (codes uint8 [capacity, page_size * dim], table
    float32 [256], scale [capacity, runs] bits, meta kind)``."""
    if load_open(source, page, out, out_bits, rows):
        return
    codes, table, scale, kind = source[OPEN_ITEMS:]
    dim = out.shape[1]
    run = out.shape[0] * dim // scale.shape[1]
    flat = out.reshape(out.size)
    end = rows * dim
    for start in range(0, end, run):
        s = float_of(scale[page, start // run], kind)
        for i in range(start, min(start + run, end)):
            flat[i] = lookup(table, codes[page, i], s)


def group_quantized_reader(arenas: dict[str, torch.Tensor], bits: int, per_channel: bool, group: int) -> CodedReader:
    """The :class:`CodedReader` of a group quantizer's field arenas (``codes``, ``scale``, ``minimum``)."""
    scale, kind = float_bits(_rows(arenas["scale"]))
    minimum, _ = float_bits(_rows(arenas["minimum"]))
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"group-quantized pages are read at 2, 3, 4 or 8 bits, got {bits}")
    fields = (arenas["codes"].numpy(), scale, minimum, kind, bits, int(per_channel), group)
    return CodedReader(fields, load_group_quantized)


def byte_table_reader(codes: torch.Tensor, table: np.ndarray, scale: torch.Tensor) -> CodedReader:
    """The :class:`CodedReader` of one-byte ``codes`` (an arena ``[capacity, ...]`` of one-byte
    patterns) decoded through ``table`` times ``scale`` (an arena ``[capacity, ...]``, one scale
    per equal run of a page's elements)."""
    scale_bits, kind = float_bits(_rows(scale))
    return CodedReader((_rows(codes.view(torch.uint8)).numpy(), table, scale_bits, kind), load_byte_table)


def _rows(arena: torch.Tensor) -> torch.Tensor:
    """``arena`` as ``[capacity, elements per page]`` (a view)."""
    return arena.view(arena.shape[0], math.prod(arena.shape[1:]))


@numba.njit(inline="always")
def load_gear(source, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """A :class:`~.gear_codec.GearQuantizer`'s page: the group codes (as :func:`load_group_quantized`),
    plus ``U V^T``, then the outliers written over. ``fields = (codes, scale, minimum, meta kind,
    bits, per_channel, group, token_factors [capacity, page_size * rank] bits, channel_factors
    [capacity, dim * rank] bits, rank, outlier_index [capacity, count], outlier_value [capacity,
    count] bits, count)``."""
    if load_open(source, page, out, out_bits, rows):
        return
    codes, scale, minimum, kind, bits, per_channel, group, tokens, channels, rank, index, value, count = source[OPEN_ITEMS:]
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


def gear_reader(arenas: dict[str, torch.Tensor], bits: int, per_channel: bool, group: int, rank: int, count: int) -> CodedReader:
    """The :class:`CodedReader` of a GEAR codec's field arenas (a group quantizer's, plus factors
    and outliers where ``rank`` and ``count`` are not 0; empty arrays stand in for absent ones)."""
    quantized = group_quantized_reader(arenas, bits, per_channel, group).fields
    empty = np.zeros((0, 0), dtype=np.uint16)
    tokens = float_bits(_rows(arenas["token_factors"]))[0] if rank else empty
    channels = float_bits(_rows(arenas["channel_factors"]))[0] if rank else empty
    index = arenas["outlier_index"].numpy() if count else np.zeros((0, 0), dtype=np.int16)
    value = float_bits(_rows(arenas["outlier_value"]))[0] if count else empty
    return CodedReader((*quantized, tokens, channels, rank, index, value, count), load_gear)
