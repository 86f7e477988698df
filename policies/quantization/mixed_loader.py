"""The mixed-precision codec's numba page reader: a sealed page decoded inside the paged-attention
kernel (the reader contract: :mod:`kvlib.kernels.page_readers`; a page decoded by :func:`load_mixed`,
then the kernel's float loops), reading what :meth:`~.mixed_codec.MixedQuantizer.dequantize`
returns, in float32."""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvlib.kernels.host_arrays import FLOAT_KINDS, host_array
from kvlib.kernels.packing import packed_code
from kvlib.kernels.page_kernel_parts import float_of
from kvlib.kernels.page_readers import loader_reader, register_numba_reader
from kvlib.policies.quantization.kernels import code_shift, dequantize

READER = "mixed"
"""The name the reader is registered under (:class:`~kvlib.kernel_readers.KernelReader` ``kernel``)."""


@numba.njit
def load_mixed(fields, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> None:  # pragma: no cover - compiled
    """A :class:`~.mixed_codec.MixedQuantizer`'s sealed page (``fields``: :func:`mixed_fields`).
    Slots are walked in order beside the ascending salient list: slot ``t`` is the ``j``-th salient
    token (``high_codes`` row ``j``) or the ``t - j``-th other one (``low_codes`` row ``t - j``)."""
    salient, high, low, scale, minimum, kind, high_bits, high_shift, low_bits, low_shift, count, per_channel, group, ratio = fields
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


def mixed_fields(tensors: tuple[torch.Tensor, ...], params: tuple[int, ...]) -> tuple:
    """The numba fields of a mixed-precision reader: its fields ``(salient, high_codes, low_codes,
    scale, minimum)`` as numpy ``[capacity, elements]`` views, then ``(meta kind, high_bits, high
    shift, low_bits, low shift, count, per_channel, group, ratio float32)`` from its params
    ``(high_bits, low_bits, count, per_channel, group)``."""
    salient, high, low, scale, minimum = (_rows(t) for t in tensors)
    high_bits, low_bits, count, per_channel, group = params
    ratio = np.float32(((1 << low_bits) - 1) / ((1 << high_bits) - 1))
    kind = FLOAT_KINDS[tensors[3].dtype]
    return (
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
        per_channel,
        group,
        ratio,
    )


def _rows(arena: torch.Tensor) -> np.ndarray:
    """``arena`` as a numpy ``[capacity, elements per page]`` view (no torch operator)."""
    array = host_array(arena)
    return array.reshape(array.shape[0], math.prod(array.shape[1:]))


MIXED = register_numba_reader(READER, loader_reader(load_mixed, mixed_fields))
"""The numba reader of :class:`~.mixed_codec.MixedQuantizer` pages."""
