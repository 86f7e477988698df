"""The KV manager's page budget with a codec: open pages count at their raw size, so the keys and
values an Engine holds between steps stay within ``page_budget_bytes``, whatever the codec (the
budget's sizes and the exact Engine's page counts: ``test_page_budget.py``)."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.model_shape import kv_shape
from tests.adapters.conftest import build_model


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return build_model("llama")


def held_kv_bytes(engine: kvlib.Engine) -> int:
    """Keys, values and codec metadata the engine's pages hold now."""
    report = engine.memory_report()["by_component"]
    return report["pages"] + report["codec_metadata"]


@pytest.mark.parametrize("spec", ["kivi(bits=4)", "rotated(bits=4)", "gear", "int8"])
def test_a_codec_engine_holds_no_more_than_its_page_budget_between_steps(llama, spec) -> None:
    shape = kv_shape(llama)
    raw_page = shape.num_layers * 16 * (shape.head_dim + shape.value_dim) * 4
    budget = 24 * raw_page
    engine = kvlib.Engine(llama, spec, page_budget_bytes=budget, max_batch_tokens=32, prefix_cache=False)
    generator = torch.Generator().manual_seed(0)
    for length in (30, 45, 21, 50, 37, 28):
        engine.add_request(torch.randint(3, 97, (length,), generator=generator).tolist(), max_new_tokens=12)
    most_running = 0
    while engine.has_unfinished:
        engine.step()
        most_running = max(most_running, engine.stats()["running"])
        assert held_kv_bytes(engine) <= budget
    assert engine.stats()["output_tokens"] == 6 * 12 and most_running > 1
