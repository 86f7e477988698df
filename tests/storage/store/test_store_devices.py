"""The store gives the same results on an accelerator as on the CPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from kvlib import PagedStore, StoreConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_script(device: str, dtype: torch.dtype, **tiers) -> list[torch.Tensor]:
    """Appends, reads, a compaction, a fork and decode steps on a store on ``device`` (with
    ``tiers``: StoreConfig's tier options); every read, on the CPU."""
    generator = torch.Generator().manual_seed(0)
    store = PagedStore(StoreConfig(2, 2, 8, page_size=4, dtype=dtype, device=device, pages_per_layer=2, **tiers))
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


@pytest.mark.parametrize("tiers", [dict(device_pages=3), dict(device_pages=3, key_summaries=True)], ids=["lru", "summaries"])
def test_cuda_tiered_store_matches_cpu_tiered_store(tiers: dict) -> None:
    """Pages that move between the device and the host on CUDA read as on the CPU."""
    for on_cpu, on_cuda in zip(run_script("cpu", torch.float32, **tiers), run_script("cuda", torch.float32, **tiers)):
        assert torch.equal(on_cpu, on_cuda)
