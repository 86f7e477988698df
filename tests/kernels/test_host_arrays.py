"""host_array: numpy views of CPU tensors' memory, made without a torch operator; float_bits: the float dtypes the kernels read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlib.kernels.host_arrays import float_bits, host_array


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool], ids=str)
def test_views_read_and_write_the_tensors_memory(dtype: torch.dtype) -> None:
    tensor = torch.arange(24).view(2, 3, 4).to(dtype)
    array = host_array(tensor)
    assert array.shape == (2, 3, 4)
    expected = tensor.view(torch.int16).numpy().view(np.uint16) if dtype in (torch.float16, torch.bfloat16) else tensor.numpy()
    np.testing.assert_array_equal(array, expected)
    array[1, 2, 3] = array[0, 0, 1]
    assert tensor[1, 2, 3] == tensor[0, 0, 1]


def test_strided_and_broadcast_views_keep_their_strides() -> None:
    base = torch.arange(12.0).view(3, 4)
    for tensor in (base.t(), base[:, 1:3], base[:1].expand(5, 4), base[1]):
        np.testing.assert_array_equal(host_array(tensor), tensor.numpy())


def test_no_torch_operator_is_dispatched_and_a_view_is_kept_per_memory() -> None:
    tensor = torch.randn(4, 5)
    host_array(tensor)
    with torch.profiler.profile() as profile:
        first, second = host_array(tensor), host_array(tensor)
    assert [event.name for event in profile.events() if event.name.startswith("aten::")] == []
    assert first is second
    assert host_array(tensor[1:]) is not first


def test_empty_tensors_and_refusals() -> None:
    assert host_array(torch.zeros(0, 3)).shape == (0, 3)
    with pytest.raises(ValueError, match="host arrays are read for"):
        host_array(torch.zeros(2, dtype=torch.complex64))


def test_float_bits_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float bits are read for"):
        float_bits(torch.zeros(2, dtype=torch.float64))
