"""A planned decode step reads nothing back from the device: no device-to-host synchronisation, so
a CUDA graph can hold it and the host never waits for the device.

Proven on the CPU by running the CUDA path's torch kernel (:mod:`kvlib.kernels.paged_attention_torch`,
what a device without triton runs) with the model and the cache's arenas on the ``meta`` device,
whose tensors hold no values: any read of a device tensor on the host (``.item()``, ``bool()``,
``.tolist()``, a copy to the CPU) raises there. Bookkeeping stays on the host, as on CUDA.

What may still read the device, and where: the prompt call (an eviction policy checks its budget,
transformers' own mask functions look at a 2-D mask), a compaction's choice of tokens, and a ring's
layout (its oldest stored positions, once per page of steps, in the forward pre-hook: outside a
compiled or captured forward). The decode steps tested here take none of these."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib import devices
from tests.adapters.conftest import build_model, left_padded


@pytest.fixture
def meta_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta device attends over pages in place with the torch kernel, as CUDA does without triton."""
    monkeypatch.setitem(devices.PAGED_KERNELS, "meta", (devices.PagedKernel.TORCH,))


def prompt_4d_mask(mask: torch.Tensor) -> torch.Tensor:
    """The prompt call's additive mask ``[batch, 1, tokens, tokens]``: causal, padding hidden (a
    padding token still sees itself, as transformers' masks keep every query row finite)."""
    tokens = mask.shape[1]
    visible = torch.ones(tokens, tokens, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    visible |= torch.eye(tokens, dtype=torch.bool)
    return torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)


def decode(model, cache, mask: torch.Tensor, steps: int) -> None:
    """``steps`` greedy-shaped decode calls (one new token per row, a 2-D mask), each planned."""
    token = torch.zeros(mask.shape[0], 1, dtype=torch.long, device=mask.device)
    with torch.no_grad():
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            model(token, attention_mask=mask, cache=cache, use_cache=True)
            assert cache.planned is not None


@pytest.mark.parametrize("lengths", [[20], [20, 13]], ids=["one-row", "left-padded"])
def test_exact_decode_steps_never_read_the_device(meta_kernel, lengths: list[int]) -> None:
    """The exact cache: the prompt (a 4-D mask where padded), then 40 planned decode steps
    crossing page boundaries, with every device tensor on ``meta``."""
    model = build_model("llama").to("meta")
    ids, mask = left_padded(lengths, seed=5)
    prompt_mask = prompt_4d_mask(mask).to("meta") if not bool(mask.all()) else None
    cache = kvlib.make_cache(model)
    with torch.no_grad():
        model(ids.to("meta"), attention_mask=prompt_mask, cache=cache, use_cache=True)
    decode(model, cache, mask.to("meta"), 40)
    assert cache.layers[0].seen == ids.shape[1] + 40


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "knorm", "snapkv+adaptive"])
def test_held_cap_decode_steps_never_read_the_device(meta_kernel, spec: str) -> None:
    """A held cap of 24 tokens with a page of slack (a compaction once 40 are stored): a 12-token
    context loaded into the cache, then the 27 decode steps before the compaction, planned (h2o
    adds up the attention each token receives on the device) with every device tensor on ``meta``.
    The load stands in for a prompt call (which may read the device) of this plain Llama, whose
    layers are then known to attend over what ``update`` returns."""
    model = build_model("llama").to("meta")
    cache = kvlib.make_cache(model, spec, budget=24)
    shape = cache.shape
    kv = [torch.empty(2, shape.num_kv_heads, 12, shape.head_dim, device="meta") for _ in range(shape.num_layers)]
    cache.load(kv, kv)
    for layer in cache.layers:
        layer.checked = True
    decode(model, cache, torch.ones(2, 12, dtype=torch.long, device="meta"), 27)
    assert int(cache.store.tables[0].lengths_np.max()) == 39


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["", "snapkv", "h2o", "kivi(bits=4)"], ids=["exact", "snapkv", "h2o", "kivi4"])
def test_cuda_decode_steps_raise_on_any_sync(spec: str) -> None:
    """On a real device: ``torch.cuda.set_sync_debug_mode("error")`` over 40 planned decode steps
    (a held cap of 24 tokens for the evictions) raises at the first synchronising call; none comes."""
    model = build_model("llama").cuda()
    ids, mask = left_padded([20, 13], seed=5)
    cache = kvlib.make_cache(model, spec or None, **({"budget": 24} if spec in ("snapkv", "h2o") else {}))
    with torch.no_grad():
        model(ids.cuda(), attention_mask=mask.cuda(), cache=cache, use_cache=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode(model, cache, mask.cuda(), 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.layers[0].seen == ids.shape[1] + 40
