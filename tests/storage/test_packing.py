"""Bit packing: exact round trips and the packed size, over bits and shapes (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.storage.packing import pack, packed_size, unpack


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), rows=st.integers(0, 4), count=st.integers(0, 67), seed=st.integers(0, 2**16))
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


@pytest.mark.parametrize("bits", [0, 3, 16])
def test_unpackable_bits_are_rejected(bits: int) -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        pack(torch.zeros(1, 4, dtype=torch.uint8), bits)
