"""Float bit patterns read as torch reads them, and open pages read exactly, by the coded loaders' shared part."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from kvlib.kernels.coded_page_loaders import float_bits, float_of, load_open, open_part


@numba.njit
def floats_of(bits: np.ndarray, kind: int, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        out[i] = float_of(bits[i], kind)


@numba.njit
def load_page(source, page: int, out: np.ndarray, rows: int) -> bool:
    return load_open(source, page, out, out.view(np.uint32), rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_reads_as_its_float(dtype: torch.dtype) -> None:
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    bits, kind = float_bits(values)
    out = np.empty(values.numel(), dtype=np.float32)
    floats_of(bits, kind, out)
    np.testing.assert_array_equal(out, values.float().numpy())  # NaN where NaN, subnormals, infinities


def test_float32_patterns_read_as_themselves() -> None:
    special = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 3.4e38, float("inf"), float("-inf"), float("nan")])
    values = torch.cat([special, torch.randn(1000) * 1e3])
    bits, kind = float_bits(values)
    out = np.empty(values.numel(), dtype=np.float32)
    floats_of(bits, kind, out)
    np.testing.assert_array_equal(out, values.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_open_pages_read_exactly_and_sealed_ones_are_left_to_the_codec(dtype: torch.dtype) -> None:
    raw = torch.randn(3, 4, 8).to(dtype)
    sealed = torch.tensor([True, False, False])
    raw_row = torch.tensor([-1, 2, 0])
    source = open_part(sealed, raw_row, raw)
    out = np.full((4, 8), -7.0, dtype=np.float32)
    assert not load_page(source, 0, out, 4) and (out == -7.0).all()
    assert load_page(source, 1, out, 3)
    np.testing.assert_array_equal(out[:3], raw[2, :3].float().numpy())
    assert (out[3] == -7.0).all()  # rows past ``rows`` are not written


def test_float_bits_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float bits are read for"):
        float_bits(torch.zeros(2, dtype=torch.float64))
