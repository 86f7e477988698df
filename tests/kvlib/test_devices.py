"""kvlib.devices: the CPU thread choice, the paged kernel of each device."""

from __future__ import annotations

import importlib.util

import numba
import numpy as np
import pytest
import torch

from kvlib import devices
from kvlib.devices import BUSY_LOAD, SMALL_MODEL_PARAMETERS, PagedKernel, cpu_threads, paged_kernel, reads_pages_in_place, set_cpu_threads
from kvlib.policies.quantization.kernels import row_absmax


def test_small_models_run_on_one_thread_on_a_busy_machine_and_a_request_wins() -> None:
    small, large = SMALL_MODEL_PARAMETERS - 1, SMALL_MODEL_PARAMETERS
    assert cpu_threads(small, load=BUSY_LOAD) == 1
    assert cpu_threads(small, load=BUSY_LOAD - 0.01) == torch.get_num_threads()
    assert cpu_threads(large, load=8.0) == torch.get_num_threads()
    assert cpu_threads(10**9, requested=3, load=8.0) == 3
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        cpu_threads(10, requested=0)


def test_the_thread_count_holds_after_a_numba_kernel_runs() -> None:
    """numba's OpenMP launches set the calling thread's OpenMP count, which torch shares."""
    before_torch, before_numba = torch.get_num_threads(), numba.get_num_threads()
    try:
        set_cpu_threads(1)
        x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
        row_absmax(x, np.empty(64, dtype=np.float32))  # a parallel numba kernel of the codecs
        assert torch.get_num_threads() == 1
        assert numba.get_num_threads() == 1
    finally:
        set_cpu_threads(before_torch)
        numba.set_num_threads(before_numba)


def test_the_cpu_reads_pages_with_numba_cuda_with_triton_or_torch_and_other_devices_densely(monkeypatch) -> None:
    assert paged_kernel(torch.device("cpu")) is PagedKernel.NUMBA
    cuda = PagedKernel.TRITON if importlib.util.find_spec("triton") else PagedKernel.TORCH
    assert paged_kernel(torch.device("cuda", 0)) is cuda  # no GPU needed to ask
    monkeypatch.setitem(devices.PAGED_KERNELS, "cuda", (PagedKernel.TORCH,))
    assert paged_kernel(torch.device("cuda", 0)) is PagedKernel.TORCH
    assert paged_kernel(torch.device("meta")) is None
    assert reads_pages_in_place(torch.device("cuda", 0)) and not reads_pages_in_place(torch.device("meta"))
