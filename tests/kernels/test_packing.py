"""Bit packing: exact round trips and the packed size, over bits and shapes (hypothesis); the numba
reader of one code agrees with :func:`unpack`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.kernels.packing import pack, packed_code, packed_size, unpack


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4, 8]), rows=st.integers(0, 4), count=st.integers(0, 67), seed=st.integers(0, 2**16))
def test_pack_then_unpack_is_exact(bits: int, rows: int, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, count), generator=generator, dtype=torch.int64).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, packed_size(count, bits))
    assert torch.equal(unpack(packed, bits, count), codes)


def test_layout_is_little_end_first() -> None:
    codes = torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3]]
    assert pack(torch.tensor([[5, 10]], dtype=torch.uint8), 4).tolist() == [[5 | 10 << 4]]


def test_packed_sizes() -> None:
    assert [packed_size(n, 4) for n in (0, 1, 2, 3, 128)] == [0, 1, 1, 2, 64]
    assert [packed_size(n, 2) for n in (1, 4, 5, 128)] == [1, 1, 2, 32]
    assert [packed_size(n, 3) for n in (0, 1, 8, 9, 1024)] == [0, 3, 3, 6, 384]  # 3 * ceil(n / 8)


def test_three_bit_codes_are_one_little_endian_bit_stream() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0, 5]], dtype=torch.uint8)
    word = sum(int(c) << (3 * k) for k, c in enumerate(codes[0, :8].tolist()))
    assert pack(codes, 3).tolist() == [[word & 255, word >> 8 & 255, word >> 16, 5, 0, 0]]


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4, 8]), count=st.integers(1, 67), seed=st.integers(0, 2**16))
def test_packed_code_reads_what_unpack_reads(bits: int, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (2, count), generator=generator, dtype=torch.int64).to(torch.uint8)
    packed = pack(codes, bits).numpy()
    shift = (8 // bits).bit_length() - 1
    assert [[packed_code(packed, r, i, bits, shift) for i in range(count)] for r in range(2)] == codes.tolist()


@pytest.mark.parametrize("bits", [0, 5, 16])
def test_unpackable_bits_are_rejected(bits: int) -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        pack(torch.zeros(1, 4, dtype=torch.uint8), bits)
