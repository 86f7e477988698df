"""Helpers for the budget allocation tests: building requests, and running an allocation through
``generate`` to count what each (layer, row, KV head) really keeps."""

from __future__ import annotations

import math

import torch

import kvlib
from kvlib.policy import BudgetRequest
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, left_padded

PAGE_SIZE = 16


def make_request(
    layer_idx: int,
    num_layers: int,
    tokens: list[int],
    counts: list[list[int]],
    scores: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
) -> BudgetRequest:
    """A :class:`BudgetRequest` from plain lists (tokens ``[batch]``, counts ``[batch][heads]``)."""
    return BudgetRequest(
        layer_idx,
        num_layers,
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int64),
        scores,
        candidates,
    )


def held_to_the_token(budget: int | float) -> dict:
    """``make_cache`` options that hold an int budget to the token while decoding (``slack=0``)."""
    return {"slack": 0} if isinstance(budget, int) else {}


def run(model, spec, budget, lengths: list[int], *, seed: int = 0, new_tokens: int = 4):
    """Greedy ``generate`` of a left-padded batch of ``lengths`` through ``make_cache(model, spec, budget)``;
    returns the cache and the input ids."""
    ids, mask = left_padded(lengths, seed=seed)
    cache = kvlib.make_cache(model, spec, budget=budget, **held_to_the_token(budget))
    model.generate(ids, attention_mask=mask, **cache_argument(cache), do_sample=False, max_new_tokens=new_tokens, pad_token_id=PAD)
    return cache, ids


def run_alone(model, spec, budget, ids: torch.Tensor, row: int, length: int, *, new_tokens: int = 4):
    """Row ``row`` of a left-padded batch run alone (its padding cut off); returns the cache."""
    cache = kvlib.make_cache(model, spec, budget=budget, **held_to_the_token(budget))
    model.generate(
        ids[row : row + 1, ids.shape[1] - length :], **cache_argument(cache), do_sample=False, max_new_tokens=new_tokens, pad_token_id=PAD
    )
    return cache


def kept_counts(cache) -> torch.Tensor:
    """int64 ``[layers, batch, kv_heads]``: tokens each head stores, counted from ``kept_positions``."""
    return torch.stack([(cache.kept_positions(layer) >= 0).sum(-1) for layer in range(cache.shape.num_layers)])


def page_bytes(cache, counts: torch.Tensor) -> int:
    """Bytes of the pages that ``counts`` tokens per head need: whole pages of ``PAGE_SIZE`` tokens
    per (layer, row, head), each ``PAGE_SIZE * (head_dim + value_dim)`` elements."""
    element = torch.empty((), dtype=cache.store.dtype).element_size()
    per_page = PAGE_SIZE * (cache.shape.head_dim + cache.shape.value_dim) * element
    return sum(math.ceil(int(count) / PAGE_SIZE) for count in counts.flatten()) * per_page


def check_memory(cache, counts: torch.Tensor) -> None:
    """The cache holds exactly the pages (and stored tokens) that ``counts`` implies."""
    report = cache.memory_report()
    assert report["by_component"]["pages"] == page_bytes(cache, counts)
    assert report["stored_tokens"] == int(counts.sum())
