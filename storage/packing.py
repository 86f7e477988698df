"""Bit packing of integer codes: 8 // bits codes per byte (4-bit: two per byte, 2-bit: four).

Codes are ``uint8`` in ``[0, 2**bits)``. Packing works along the last dimension: ``n`` codes
become ``packed_size(n, bits)`` bytes; code ``i`` of a byte sits at bits ``[bits*i, bits*(i+1))``
(little end first). A last byte that is not full is padded with zero codes. Vectorized torch
ops only (no Python loop over elements), on any device; :func:`packed_code` reads one code of
that layout inside numba kernels.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

PACKABLE_BITS = (1, 2, 4, 8)


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits take."""
    per_byte = 8 // bits
    return -(-count // per_byte)


@numba.njit(inline="always")
def packed_code(packed: np.ndarray, row: int, i: int, bits: int, shift: int) -> int:
    """Code ``i`` of row ``row`` of ``packed`` (uint8 ``[rows, bytes]``, :func:`pack`'s layout)
    at ``bits`` bits, ``2**shift = 8 // bits`` codes per byte (numba; constants fold when inlined)."""
    return (packed[row, i >> shift] >> ((i & ((1 << shift) - 1)) * bits)) & ((1 << bits) - 1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (uint8 ``[..., n]``, each below ``2**bits``) into uint8 ``[..., packed_size(n, bits)]``."""
    _check_bits(bits)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    count = codes.shape[-1]
    padded = packed_size(count, bits) * per_byte
    if padded != count:
        codes = torch.nn.functional.pad(codes, (0, padded - count))
    grouped = codes.reshape(*codes.shape[:-1], padded // per_byte, per_byte)
    packed = grouped[..., 0].clone()
    for i in range(1, per_byte):
        packed |= grouped[..., i] << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes held by ``packed`` (uint8 ``[..., bytes]``): uint8 ``[..., count]``."""
    _check_bits(bits)
    if bits == 8:
        return packed[..., :count]
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)[..., :count]


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits!r}")
