"""What every coded page loader shares: reading a coded pool's open pages, and float bit patterns.

The paged-attention kernel (:mod:`kvlib.kernels.paged_attention`) reads each page through a loader
``load(source, page, out, out_bits, rows)`` that writes the page's first ``rows`` tokens as
float32 into scratch ``out [page_size, dim]`` (``out_bits``: the same scratch viewed as uint32).
A coded pool (:class:`~kvlib.storage.coded_pool.CodedPages`) holds two kinds of pages, so a
coded loader's ``source`` is the flat tuple ``open_part + fields`` (flat: numba's parallel loops
take a tuple's items as their arguments, but not a tuple nested in a tuple):

- ``open_part = (sealed, raw_row, raw, kind)`` (:data:`OPEN_ITEMS` items): ``sealed`` bool
  ``[capacity]``, ``raw_row`` int64 ``[capacity]`` (each open page's row in ``raw``), ``raw`` the
  open pages in the compute dtype as bit patterns (uint32 ``[raw_rows, page_size, dim]`` for
  float32, uint16 for float16 and bfloat16), ``kind`` which float they are (:data:`FLOAT_KINDS`).
  :func:`load_open` reads a page from it when the page is open;
- ``fields``: the codec's own (its field arenas, indexed by page id, and its parameters), which
  the codec's loader decodes when the page is sealed (:class:`~kvlib.codec.CodedReader`, given by
  :meth:`~kvlib.codec.TensorCodec.page_reader`).

Bit patterns rather than floats: numba's CPU target loads neither float16 nor bfloat16, and one
array type per pool keeps the kernel to one compilation per codec layout.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvlib.kernels.page_kernel_parts import half_to_float

FLOAT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""How float bit patterns are read: 0 float32 (uint32 bits), 1 float16, 2 bfloat16 (uint16 bits)."""

OPEN_ITEMS = 4
"""Items of a coded loader's source before the codec's fields (``source[OPEN_ITEMS:]``)."""


def float_bits(tensor: torch.Tensor) -> tuple[np.ndarray, int]:
    """A CPU float tensor's bit patterns as numpy (no copy: uint32 for float32, uint16 for float16
    and bfloat16) and its :data:`FLOAT_KINDS` kind."""
    if tensor.dtype not in FLOAT_KINDS:
        raise ValueError(f"float bits are read for {tuple(FLOAT_KINDS)}, got {tensor.dtype}")
    if tensor.dtype == torch.float32:
        return tensor.view(torch.int32).numpy().view(np.uint32), 0
    return tensor.view(torch.int16).numpy().view(np.uint16), FLOAT_KINDS[tensor.dtype]


def open_part(sealed: torch.Tensor, raw_row: torch.Tensor, raw: torch.Tensor) -> tuple:
    """The ``open_part`` of a coded loader's source (see the module docstring), no copy."""
    bits, kind = float_bits(raw)
    return sealed.numpy(), raw_row.numpy(), bits, kind


@numba.njit(inline="always")
def float_of(bits, kind: int) -> np.float32:
    """The float32 value of one float32, float16 or bfloat16 bit pattern (``kind``: :data:`FLOAT_KINDS`).
    A normal float16 is widened by moving its bits (exponent rebiased by 127 - 15 = 112), the rest
    (zeros, subnormals, infinities, NaN) through :func:`~kvlib.kernels.page_kernel_parts.half_to_float`."""
    if kind == 1:
        half = np.uint32(bits)
        exponent = (half >> np.uint32(10)) & np.uint32(0x1F)
        if 0 < exponent < 31:
            sign = (half & np.uint32(0x8000)) << np.uint32(16)
            return np.uint32(sign | (((half & np.uint32(0x7FFF)) + np.uint32(112 << 10)) << np.uint32(13))).view(np.float32)
        return half_to_float(bits)
    if kind == 2:
        return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)
    return np.uint32(bits).view(np.float32)


@numba.njit(inline="always")
def load_open(source, page: int, out: np.ndarray, out_bits: np.ndarray, rows: int) -> bool:
    """If ``page`` is open, write its first ``rows`` tokens as float32 into ``out`` and return
    True; return False for a sealed page (the codec's loader decodes it). ``source``: a coded
    loader's (its first :data:`OPEN_ITEMS` items are read)."""
    sealed, raw_row, raw, kind = source[0], source[1], source[2], source[3]
    if sealed[page]:
        return False
    row = raw_row[page]
    if kind == 1:
        for t in range(rows):
            for c in range(out.shape[1]):
                out[t, c] = half_to_float(raw[row, t, c])
    elif kind == 2:
        for t in range(rows):
            for c in range(out.shape[1]):
                out_bits[t, c] = np.uint32(raw[row, t, c]) << np.uint32(16)
    else:
        for t in range(rows):
            for c in range(out.shape[1]):
                out_bits[t, c] = np.uint32(raw[row, t, c])
    return True
