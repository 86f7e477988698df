"""The mixed-precision codec's page loader: a sealed page decoded inside the paged-attention
kernel (see :mod:`~.page_loaders` for the loader contract), reading what
:meth:`~.mixed_codec.MixedQuantizer.dequantize` returns, in float32."""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvlib.codec import CodedReader
from kvlib.kernels.coded_page_loaders import OPEN_ITEMS, float_bits, float_of, load_open
from kvlib.kernels.packing import packed_code
from kvlib.strategies.quantization.kernels import code_shift, dequantize


@numba.njit(inline="always")
def load_mixed(source, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:
    """A :class:`~.mixed_codec.MixedQuantizer`'s page. ``fields = (salient [capacity, count],
    high_codes, low_codes uint8 [capacity, bytes], scale, minimum [capacity, groups] bits, meta
    kind, high_bits, high shift, low_bits, low shift, count, per_channel, group, ratio float32)``.
    Slots are walked in order beside the ascending salient list: slot ``t`` is the ``j``-th salient
    token (``high_codes`` row ``j``) or the ``t - j``-th other one (``low_codes`` row ``t - j``)."""
    if load_open(source, page, out, out_bits, rows):
        return
    salient, high, low, scale, minimum, kind, high_bits, high_shift, low_bits, low_shift, count, per_channel, group, ratio = source[
        OPEN_ITEMS:
    ]
    dim = out.shape[1]
    groups = dim // group
    j = 0
    for t in range(rows):
        is_high = j < count and np.int64(salient[page, j]) == t
        for c in range(dim):
            if is_high:
                code = packed_code(high, page, j * dim + c, high_bits, high_shift)
            else:
                code = packed_code(low, page, (t - j) * dim + c, low_bits, low_shift)
            if per_channel:
                s = float_of(scale[page, c], kind)
                if is_high:
                    s = s * ratio
                m = float_of(minimum[page, c], kind)
            else:
                s = float_of(scale[page, t * groups + c // group], kind)
                m = float_of(minimum[page, t * groups + c // group], kind)
            out[t, c] = dequantize(code, s, m)
        if is_high:
            j += 1


def mixed_reader(arenas: dict[str, torch.Tensor], high_bits: int, low_bits: int, count: int, per_channel: bool, group: int) -> CodedReader:
    """The :class:`CodedReader` of a mixed-precision codec's field arenas (empty arrays stand in
    for the salient fields when ``count`` is 0, and for the low codes when every token is salient)."""
    scale, kind = float_bits(_rows(arenas["scale"]))
    minimum, _ = float_bits(_rows(arenas["minimum"]))
    empty = np.zeros((0, 0), dtype=np.uint8)
    salient = arenas["salient"].numpy() if "salient" in arenas else empty
    high = arenas["high_codes"].numpy() if "high_codes" in arenas else empty
    low = arenas["low_codes"].numpy() if "low_codes" in arenas else empty
    ratio = np.float32(((1 << low_bits) - 1) / ((1 << high_bits) - 1))
    fields = (
        salient,
        high,
        low,
        scale,
        minimum,
        kind,
        high_bits,
        code_shift(high_bits),
        low_bits,
        code_shift(low_bits),
        count,
        int(per_channel),
        group,
        ratio,
    )
    return CodedReader(fields, load_mixed)


def _rows(arena: torch.Tensor) -> torch.Tensor:
    """``arena`` as ``[capacity, elements per page]`` (a view)."""
    return arena.view(arena.shape[0], math.prod(arena.shape[1:]))
