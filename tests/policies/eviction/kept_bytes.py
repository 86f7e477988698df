"""Shared checks of the eviction tests of issue 23's policies: the budget met per (layer, head)
and ``memory_report``'s bytes matching the tokens kept (pages, not masks)."""

from __future__ import annotations

import torch


def assert_budget_and_bytes(cache, budget: int) -> None:
    """Every (layer, row, head) holds exactly ``budget`` tokens, and the report's stored tokens and
    page bytes are those of the kept tokens: ``ceil(kept / page_size)`` pages per head."""
    store, shape = cache.store, cache.shape
    page_bytes = store.page_size * (shape.head_dim + shape.value_dim) * store.dtype.itemsize
    tokens = pages = 0
    for layer in range(shape.num_layers):
        kept = (cache.kept_positions(layer) >= 0).sum(-1)
        assert bool((kept == budget).all()), (layer, kept)
        held = store.physical_lengths(layer, cache.rows)
        tokens += int(held.sum())
        pages += int(((held + store.page_size - 1) // store.page_size).sum())
    report = cache.memory_report()
    assert report["stored_tokens"] == tokens
    assert report["by_component"]["pages"] == pages * page_bytes
    assert report["by_component"]["pages"] < report["full_equivalent_bytes"]


def same_positions_in_every_head(cache, layer: int) -> bool:
    kept = cache.kept_positions(layer)
    return bool((kept == kept[:, :1]).all())


def smollm2_prompt(loaded) -> torch.Tensor:
    text = (
        "Alice keeps the blue key in the kitchen drawer. Bob parks his red car behind the old barn. "
        "The meeting moved to Thursday at noon because the projector broke. Where is the blue key?"
    )
    return torch.tensor([loaded.tokenizer.encode(text, bos=True)])
