"""Bit packing of integer codes: 8 // bits codes per byte (4-bit: two per byte, 2-bit: four), and
3-bit codes eight to three bytes.

Codes are ``uint8`` in ``[0, 2**bits)``. Packing works along the last dimension: ``n`` codes
become ``packed_size(n, bits)`` bytes. The packed bytes are one little-endian bit stream: code
``i`` sits at stream bits ``[bits*i, bits*(i+1))``, byte ``b`` holds stream bits ``[8b, 8b+8)``
(little end first). For 1, 2, 4 and 8 bits a code never straddles a byte; 3-bit codes go in
units of 8 codes per 3 bytes (a 24-bit little-endian word, code ``k`` of a unit at bits
``[3k, 3k+3)``), so ``packed_size(n, 3) = 3 * ceil(n / 8)``. A last byte (unit) that is not full
is padded with zero codes. Vectorized torch ops only (no Python loop over elements), on any
device; :func:`packed_code` reads one code of that layout inside numba kernels.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

PACKABLE_BITS = (1, 2, 3, 4, 8)


def unit_codes(bits: int) -> int:
    """Codes per packing unit: ``8 // bits`` codes per byte, or 8 codes per 3 bytes at 3 bits."""
    return 8 if bits == 3 else 8 // bits


def unit_bytes(bits: int) -> int:
    """Bytes per packing unit (3 at 3 bits, else 1)."""
    return 3 if bits == 3 else 1


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits take: whole units of :func:`unit_codes` codes."""
    return -(-count // unit_codes(bits)) * unit_bytes(bits)


@numba.njit(inline="always")
def packed_code(packed: np.ndarray, row: int, i: int, bits: int, shift: int) -> int:
    """Code ``i`` of row ``row`` of ``packed`` (uint8 ``[rows, bytes]``, :func:`pack`'s layout)
    at ``bits`` bits; for 1, 2, 4 or 8 bits ``2**shift = 8 // bits`` codes per byte, at 3 bits
    ``shift`` is unused (numba; constants fold when inlined)."""
    if bits == 3:
        bit = 3 * i
        byte = bit >> 3
        offset = bit & 7
        value = np.int32(packed[row, byte]) >> offset
        if offset > 5:  # the code straddles into the next byte (within its 3-byte unit)
            value |= np.int32(packed[row, byte + 1]) << (8 - offset)
        return value & 7
    return (packed[row, i >> shift] >> ((i & ((1 << shift) - 1)) * bits)) & ((1 << bits) - 1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (uint8 ``[..., n]``, each below ``2**bits``) into uint8 ``[..., packed_size(n, bits)]``."""
    _check_bits(bits)
    if bits == 8:
        return codes
    per_unit = unit_codes(bits)
    count = codes.shape[-1]
    padded = -(-count // per_unit) * per_unit
    if padded != count:
        codes = torch.nn.functional.pad(codes, (0, padded - count))
    grouped = codes.reshape(*codes.shape[:-1], padded // per_unit, per_unit)
    if bits == 3:
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)
        word = (grouped.to(torch.int32) << shifts).sum(-1, dtype=torch.int32)
        octets = torch.stack((word, word >> 8, word >> 16), -1) & 255
        return octets.to(torch.uint8).reshape(*codes.shape[:-1], 3 * grouped.shape[-2])
    packed = grouped[..., 0].clone()
    for i in range(1, per_unit):
        packed |= grouped[..., i] << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes held by ``packed`` (uint8 ``[..., bytes]``): uint8 ``[..., count]``."""
    _check_bits(bits)
    if bits == 8:
        return packed[..., :count]
    if bits == 3:
        units = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
        word = units[..., 0] | units[..., 1] << 8 | units[..., 2] << 16
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
        codes = ((word.unsqueeze(-1) >> shifts) & 7).to(torch.uint8)
        return codes.reshape(*packed.shape[:-1], 8 * units.shape[-2])[..., :count]
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :count]


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits!r}")
