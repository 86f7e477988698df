"""The Engine's page budget (kvlib.adapters.engine.page_budget): with a codec, an open page costs
its raw bytes in encoded pages, in the budget's sizes and in the KV manager's page counts; without
one, every page costs one."""

from __future__ import annotations

import torch

import kvlib
from kvlib.adapters.engine.page_budget import page_budget
from kvlib.model_shape import kv_shape
from tests.adapters.conftest import build_model


def test_an_open_page_costs_its_raw_bytes_in_encoded_pages() -> None:
    llama = build_model("llama")
    shape = kv_shape(llama)
    common = {"page_size": 16, "dtype": torch.float32, "device": torch.device("cpu"), "prefix_cache_bytes": None}
    exact = page_budget(shape, codec=None, page_budget_bytes=2**20, **common)
    kivi = page_budget(shape, codec=kvlib.parse_spec("kivi(bits=4)").quantization, page_budget_bytes=2**20, **common)
    raw = 16 * (shape.head_dim + shape.value_dim) * 4
    coded = kivi.codecs[0].page_bytes()
    assert exact.open_page_cost == 1 and exact.pages == 2**20 // (shape.num_layers * raw)
    assert kivi.open_page_cost == -(-raw // coded) > 1 and kivi.pages == 2**20 // (shape.num_layers * coded)
    engine = kvlib.Engine(llama, "kivi(bits=4)", page_budget_bytes=2**20)
    kv = engine.kv
    assert kv.pages_for(0, 1) == shape.num_kv_heads * kivi.open_page_cost  # a new open page
    assert kv.pages_for(1, 14) == 0  # filling the open page costs nothing more
    assert kv.pages_for(15, 1) == shape.num_kv_heads * (1 - kivi.open_page_cost)  # sealed: its raw bytes come back
    assert kv.pages_for(0, 40) == shape.num_kv_heads * (2 + kivi.open_page_cost)
