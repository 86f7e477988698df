"""The one-byte codecs' Triton tile loaders: :class:`~kvlib.strategies.quantization.uniform.AbsmaxInt8`
and :class:`~kvlib.strategies.quantization.fp8.PageScaledFP8` sealed pages decoded in registers
inside the Triton paged-attention kernel (the loader contract: :mod:`kvlib.triton_readers`).

``fields = (codes [capacity, page_size * dim] one byte each, scale [capacity, runs])``,
``params = (run,)``: element ``i`` of a page is its code's value times the scale of run ``i //
run`` (int8: one scale per token, metadata floats; fp8: one float32 per page). int8 codes are
read as signed bytes; fp8 codes are e4m3 bit patterns widened to float32 from their bits (exact
on every device, whatever its float8 support), which is what the numba loaders' 256-entry
tables (:func:`~kvlib.strategies.quantization.page_loaders.load_byte_table`) hold.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlib.kernels.triton_tiles import open_tile
from kvlib.triton_readers import TritonReader


@triton.jit
def scaled_bytes(page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(tokens, coded, byte codes, scales)`` of a tile: the open part (:func:`~kvlib.kernels.triton_tiles.open_tile`),
    then, each ``[BLOCK_N, BLOCK_D]``, the ``coded`` tokens' codes (``tensors`` ``(raw, raw_row,
    sealed, codes, scale)``: ``codes`` rows of ``PAGE_SIZE * DIM`` one-byte codes, as loaded: int8
    or uint8) and their scales (``scale`` rows of one scale per ``params[0]`` elements, as
    float32); 0 where not ``coded`` and past ``DIM``."""
    RUN: tl.constexpr = params[0]
    tokens, coded = open_tile(page, slot, stored, tensors, DIM, PAGE_SIZE, BLOCK_D)
    channel = tl.arange(0, BLOCK_D)[None, :]
    inside = coded[:, None] & (channel < DIM)
    element = slot[:, None] * DIM + channel
    code = tl.load(tensors[3] + page[:, None] * (PAGE_SIZE * DIM) + element, mask=inside, other=0)
    step = tl.load(tensors[4] + page[:, None] * (PAGE_SIZE * DIM // RUN) + element // RUN, mask=inside, other=0.0).to(tl.float32)
    return tokens, coded, code, step


@triton.jit
def load_int8(page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """An absmax int8 tile loader: ``code * scale`` (int8 codes, a scale per ``params[0]`` elements)."""
    tokens, coded, code, step = scaled_bytes(page, slot, stored, tensors, params, DIM, PAGE_SIZE, BLOCK_D)
    return tl.where(coded[:, None], code.to(tl.float32) * step, tokens)


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
def load_e4m3(page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    """A page-scaled fp8 tile loader: the e4m3 value of each byte times its scale (one per ``params[0]`` elements)."""
    tokens, coded, code, step = scaled_bytes(page, slot, stored, tensors, params, DIM, PAGE_SIZE, BLOCK_D)
    return tl.where(coded[:, None], e4m3_value(code) * step, tokens)


def scaled_bytes_triton_reader(load: object, codes: torch.Tensor, scale: torch.Tensor) -> TritonReader:
    """The :class:`TritonReader` of one-byte ``codes`` (an arena ``[capacity, ...]``) with ``scale``
    (an arena ``[capacity, ...]``, one scale per equal run of a page's elements), read by ``load``
    (:func:`load_int8` or :func:`load_e4m3`)."""
    run = math.prod(codes.shape[1:]) // math.prod(scale.shape[1:])
    return TritonReader(load, (codes.contiguous(), scale.contiguous()), (run,))
