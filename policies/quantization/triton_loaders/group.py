"""The group quantizers' Triton tile loader (kivi, kv_bits, and rotated's inner codes): a
:class:`~kvlib.policies.quantization.uniform.GroupQuantizer`'s sealed pages decoded in registers
inside the Triton paged-attention kernel (the loader contract: :mod:`kvlib.kernels.triton_tiles`),
registered as the ``"group"`` reader.

``fields = (codes uint8 [capacity, bytes], scale, minimum [capacity, groups] metadata floats)``,
``params = (bits, per_channel, group)``. Code ``i = t * dim + c`` of token ``t``, channel ``c``
is read from the packed bytes (:mod:`kvlib.kernels.packing`'s layout: ``8 // bits`` codes per
byte, little end first; 3-bit codes 8 per 3 bytes) and decoded as ``minimum + scale * code``
of its group (channel ``c`` per channel, else ``i // group``), as the numba loader does
(:func:`~kvlib.policies.quantization.page_readers.decode_page_groups`): the kernel reads the codec's
float32 decode, never rounded to the compute dtype. Scales and minima are read in their stored
dtype and widened to float32. Parameters are constexpr: each bit width and layout is its own
compilation, with constant shifts and masks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlib.kernels.page_readers import register_triton_loader
from kvlib.kernels.triton_tiles import open_tile


@triton.jit
def packed_codes(codes, page, element, inside, BITS: tl.constexpr, COUNT: tl.constexpr):
    """int32 codes ``element`` (``[BLOCK_N, BLOCK_D]``, each token's own page ``page``) of
    ``codes`` (uint8 rows of ``COUNT`` codes at ``BITS`` bits, :func:`~kvlib.kernels.packing.pack`'s
    layout), 0 where not ``inside``."""
    if BITS == 3:  # 8 codes per 3-byte unit: a code may straddle two bytes of its unit
        base = codes + page[:, None] * ((COUNT + 7) // 8 * 3)
        bit = element * 3
        byte = bit >> 3
        offset = bit & 7
        low = tl.load(base + byte, mask=inside, other=0).to(tl.int32)
        high = tl.load(base + byte + 1, mask=inside & (offset > 5), other=0).to(tl.int32)
        return ((low >> offset) | (high << (8 - offset))) & 7
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        base = codes + page[:, None] * ((COUNT + PER_BYTE - 1) // PER_BYTE)
        byte = tl.load(base + element // PER_BYTE, mask=inside, other=0).to(tl.int32)
        return (byte >> ((element % PER_BYTE) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def group_tile(page, slot, coded, codes, scale, minimum, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """float32 ``[BLOCK_N, BLOCK_D]``: the ``coded`` tokens of a group quantizer's sealed pages,
    decoded (0 elsewhere); ``params`` ``(bits, per_channel, group)``, see the module docstring."""
    BITS: tl.constexpr = params[0]
    PER_CHANNEL: tl.constexpr = params[1]
    GROUP: tl.constexpr = params[2]
    channel = tl.arange(0, BLOCK_D)[None, :]
    inside = coded[:, None] & (channel < DIM)
    element = slot[:, None] * DIM + channel
    code = packed_codes(codes, page, element, inside, BITS, PAGE_SIZE * DIM)
    if PER_CHANNEL:
        group = page[:, None] * DIM + channel
    else:
        group = page[:, None] * (PAGE_SIZE * DIM // GROUP) + element // GROUP
    step = tl.load(scale + group, mask=inside, other=0.0).to(tl.float32)
    low = tl.load(minimum + group, mask=inside, other=0.0).to(tl.float32)
    return low + step * code.to(tl.float32)


@triton.jit
def load_group_quantized(
    page, slot, stored, tensors, params, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr
):
    """A group quantizer's tile loader (open pages raw, sealed ones through :func:`group_tile`);
    ``tensors`` ``(raw, raw_row, sealed, codes, scale, minimum)``."""
    tokens, coded = open_tile(page, slot, stored, tensors, DIM, PAGE_SIZE, BLOCK_D)
    decoded = group_tile(page, slot, coded, tensors[3], tensors[4], tensors[5], params, DIM, PAGE_SIZE, BLOCK_D)
    return tl.where(coded[:, None], decoded, tokens)


LOADER = register_triton_loader("group", load_group_quantized)
