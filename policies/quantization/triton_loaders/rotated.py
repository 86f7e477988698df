"""The ``rotated`` codec's Triton tile loader: a :class:`~kvlib.policies.quantization.hadamard.RotatedQuantizer`'s
sealed pages decoded and rotated back in registers inside the Triton paged-attention kernel (the
loader contract: :mod:`kvlib.kernels.triton_tiles`), registered as the ``"rotated"`` reader.

A sealed page's rows are the group quantizer's codes of ``y = R_h x`` (``R_h = H D_h /
sqrt(d)``, :mod:`~kvlib.policies.quantization.hadamard`); the loader decodes ``y`` as
:func:`~.group.group_tile` does, then undoes the rotation, ``x = (y H / sqrt(d)) * signs[h]``,
with ``H`` (Sylvester's, ``H[j, c] = (-1)**popcount(j & c)``, built in registers) applied at
float32's precision (:func:`~kvlib.kernels.triton_products.dot_exact_right`, on tensor cores for a half
``DOT``) and ``h`` the page's KV head, read from its ``head`` field. Open pages (never rotated)
are read raw. The product sums each row in another order than the numba loader's butterflies
(:func:`~kvlib.policies.quantization.hadamard.butterflies`): results agree to float32 rounding,
not bit for bit. Head dims above :data:`~kvlib.policies.quantization.hadamard.MAX_TRITON_DIM` have
no reader (read densely).

``fields = (codes, scale, minimum, head uint8 [capacity, 1], signs int8 [kv_heads, dim])``,
``params = (bits, per_channel, group)`` of the inner group quantizer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlib.kernels.page_readers import register_triton_loader
from kvlib.kernels.triton_products import dot_exact_right
from kvlib.kernels.triton_tiles import open_tile
from kvlib.policies.quantization.triton_loaders.group import group_tile


@triton.jit
def hadamard_matrix(DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """float32 ``[BLOCK_D, BLOCK_D]``: Sylvester's ``DIM x DIM`` Hadamard matrix (entries +-1, the
    parity of ``popcount(j & c)``), 0 outside it."""
    index = tl.arange(0, BLOCK_D)
    common = index[:, None] & index[None, :]
    parity = common ^ (common >> 16)
    parity = parity ^ (parity >> 8)
    parity = parity ^ (parity >> 4)
    parity = parity ^ (parity >> 2)
    parity = (parity ^ (parity >> 1)) & 1
    inside = (index < DIM)[:, None] & (index < DIM)[None, :]
    return tl.where(inside, 1.0 - 2.0 * parity.to(tl.float32), 0.0)


@triton.jit
def load_rotated(page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """A rotated quantizer's tile loader (see the module docstring); ``tensors`` ``(raw, raw_row,
    sealed, codes, scale, minimum, head, signs)``, ``params`` the inner group quantizer's."""
    tokens, coded = open_tile(page, slot, stored, tensors, DIM, PAGE_SIZE, BLOCK_D)
    rotated = group_tile(page, slot, coded, tensors[3], tensors[4], tensors[5], params, DIM, PAGE_SIZE, BLOCK_D)
    summed = dot_exact_right(rotated, hadamard_matrix(DIM, BLOCK_D), DOT)
    channel = tl.arange(0, BLOCK_D)[None, :]
    inside = coded[:, None] & (channel < DIM)
    kv_head = tl.load(tensors[6] + page, mask=coded, other=0).to(tl.int32)
    sign = tl.load(tensors[7] + kv_head[:, None] * DIM + channel, mask=inside, other=0).to(tl.float32)
    NORM: tl.constexpr = DIM**-0.5
    return tl.where(coded[:, None], (summed * NORM) * sign, tokens)


LOADER = register_triton_loader("rotated", load_rotated)
