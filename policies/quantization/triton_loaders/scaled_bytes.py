"""The one-byte codecs' Triton tile loader: :class:`~kvlib.policies.quantization.uniform.AbsmaxInt8`
and :class:`~kvlib.policies.quantization.fp8.PageScaledFP8` sealed pages decoded in registers
inside the Triton paged-attention kernel (the loader contract: :mod:`kvlib.kernels.triton_tiles`),
registered as the ``"scaled_bytes"`` reader.

``fields = (codes [capacity, page_size * dim] one byte each, scale [capacity, runs])``,
``params = (codes kind, run)``: element ``i`` of a page is its code's value times the scale of
run ``i // run`` (int8: one scale per token, metadata floats; fp8: one float32 per page). int8
codes (kind 0) are read as signed bytes; fp8 codes (kind 1) are e4m3 bit patterns widened to
float32 from their bits (exact on every device, whatever its float8 support), as the numba
reader does (:func:`~kvlib.policies.quantization.page_readers.e4m3_value`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlib.kernels.page_readers import register_triton_loader
from kvlib.kernels.triton_tiles import open_tile


@triton.jit
def scaled_bytes(page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(tokens, coded, byte codes, scales)`` of a tile: the open part (:func:`~kvlib.kernels.triton_tiles.open_tile`),
    then, each ``[BLOCK_N, BLOCK_D]``, the ``coded`` tokens' codes (``tensors`` ``(raw, raw_row,
    sealed, codes, scale)``: ``codes`` rows of ``PAGE_SIZE * DIM`` one-byte codes, as loaded: int8
    or uint8) and their scales (``scale`` rows of one scale per ``params[1]`` elements, as
    float32); 0 where not ``coded`` and past ``DIM``."""
    RUN: tl.constexpr = params[1]
    tokens, coded = open_tile(page, slot, stored, tensors, DIM, PAGE_SIZE, BLOCK_D)
    channel = tl.arange(0, BLOCK_D)[None, :]
    inside = coded[:, None] & (channel < DIM)
    element = slot[:, None] * DIM + channel
    code = tl.load(tensors[3] + page[:, None] * (PAGE_SIZE * DIM) + element, mask=inside, other=0)
    step = tl.load(tensors[4] + page[:, None] * (PAGE_SIZE * DIM // RUN) + element // RUN, mask=inside, other=0.0).to(tl.float32)
    return tokens, coded, code, step


@triton.jit
def e4m3_value(byte):
    """float32 of float8 e4m3fn bit patterns (uint8): ``(8 + m) * 2**(e - 10)``, subnormals
    ``m * 2**-9``, sign kept, ``0x7F``/``0xFF`` NaN; built from bits, so exact on every device."""
    bits = byte.to(tl.uint32)
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    sign = (bits & 128) << 24
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    tiny = mantissa.to(tl.float32) * 0.001953125
    subnormal = tl.where(sign != 0, -tiny, tiny)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((bits & 127) == 127, float("nan"), value)


@triton.jit
def load_scaled_bytes(
    page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr
):
    """A one-byte codec's tile loader: each code's value (``params[0]``: 0 a signed byte, 1 an
    e4m3 bit pattern) times its scale (one per ``params[1]`` elements)."""
    CODES: tl.constexpr = params[0]
    tokens, coded, code, step = scaled_bytes(page, slot, stored, tensors, params, DIM, PAGE_SIZE, BLOCK_D)
    if CODES == 0:
        value = code.to(tl.float32)
    else:
        value = e4m3_value(code)
    return tl.where(coded[:, None], value * step, tokens)


LOADER = register_triton_loader("scaled_bytes", load_scaled_bytes)
