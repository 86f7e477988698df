"""A planned decode step traces whole under ``torch.compile(fullgraph=True)``: kvlib's bookkeeping
runs in the forward pre-hook (``KVCache.prepare_step``), the forward itself is the model's
operators and kvlib's custom ops (``kvlib::write_planned``, ``kvlib::paged_decode``)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model, left_padded

STEPS = 12


def decode(model: torch.nn.Module, cache: kvlib.KVCache, ids: torch.Tensor, mask: torch.Tensor, forward=None) -> list[torch.Tensor]:
    """The prompt through the model (eager), then ``STEPS`` greedy decode steps through ``model(...)``
    with its forward replaced by ``forward`` if given (its forward pre-hooks still run eagerly:
    kvlib plans each step there)."""
    original = model.forward
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **cache_argument(cache), use_cache=True).logits
        token, tokens = logits[:, -1:].argmax(-1), []
        if forward is not None:
            model.forward = forward
        try:
            for _ in range(STEPS):
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                position = mask.sum(-1, keepdim=True) - 1
                logits = model(token, attention_mask=mask, position_ids=position, **cache_argument(cache), use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                tokens.append(token)
        finally:
            model.forward = original
    return tokens


@pytest.mark.parametrize("spec, budget", [(None, None), ("streaming_llm", 16)], ids=["exact", "held-cap-ring"])
def test_decode_steps_compile_at_most_twice_and_give_the_eager_tokens(spec: str | None, budget: int | None) -> None:
    """12 decode steps of a left-padded batch: no graph break (``fullgraph=True``), at most two
    compilations (the first step's, then one with the growing lengths dynamic), the eager tokens."""
    model = build_model("llama")
    ids, mask = left_padded([11, 20], seed=3, vocab=model.config.vocab_size)
    make = (lambda: kvlib.make_cache(model)) if spec is None else (lambda: kvlib.make_cache(model, spec, budget=budget))
    eager = decode(model, make(), ids, mask)
    counter = CompileCounter()
    try:
        compiled = decode(model, make(), ids, mask, torch.compile(model.forward, backend=counter, fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count <= 2
    assert torch.equal(torch.cat(compiled, 1), torch.cat(eager, 1))
