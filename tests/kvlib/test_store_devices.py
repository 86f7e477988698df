"""The store gives the same results on an accelerator as on the CPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from kvlib import PagedStore, StoreConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_script(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    store = PagedStore(StoreConfig(2, 2, 8, page_size=4, dtype=dtype, device=device, pages_per_layer=2))
    a, b = store.new_sequence(), store.new_sequence()
    outputs = []
    for layer in range(2):
        prompt = torch.randn(2, 2, 9, 8, generator=generator).to(device, dtype)
        store.append(layer, [a, b], prompt, -prompt)
        outputs.extend(store.read(layer, [a, b]))
        keep = torch.tensor([[[0, 3, 8], [1, 2, -1]], [[4, 5, 6], [0, 7, 8]]])
        store.compact(layer, [a, b], keep)
        child = store.fork(a)
        for step in range(3):
            token = torch.randn(2, 2, 1, 8, generator=generator).to(device, dtype)
            store.append(layer, [a, b], token, token, torch.tensor([[9 + step], [20 + step]]))
            outputs.extend(store.read(layer, [a, b]))
        outputs.extend(store.read(layer, [child]))
    return [t.cpu() for t in outputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_store_matches_cpu_store(dtype: torch.dtype) -> None:
    for on_cpu, on_cuda in zip(run_script("cpu", dtype), run_script("cuda", dtype)):
        assert torch.equal(on_cpu, on_cuda)
