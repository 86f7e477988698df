"""Prefill by scores measured first: what the context-first procedures of KVzip and KVCompose share.

Both measure every context token's score in passes of their own (KVzip's reconstruction, KVCompose's
repeat pass), then prefill the context into an empty kvlib cache whose policy ranks by those scores
(its ``measured`` field, set for that one call), and leave the compressed context uncompressed from
then on (the evictor removed): questions and answers follow it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

Measuring = TypeVar("Measuring")


def empty_cache_policy(cache: Any, kind: type[Measuring], name: str) -> Measuring:
    """The ``kind`` policy of ``cache``; ``ValueError`` unless it is an empty kvlib cache made with
    ``make_cache(model, name, budget=...)``."""
    evictor = getattr(cache, "evictor", None)
    policy = getattr(evictor, "policy", None)
    if not isinstance(policy, kind) or evictor.budget is None:
        raise ValueError(f"compress needs a cache made with make_cache(model, {name!r}, budget=...)")
    if cache.batch_size != -1:
        raise ValueError("compress needs an empty cache: call cache.reset() first")
    return policy


def prefill_measured(model: torch.nn.Module, cache: Any, context_ids: torch.Tensor, policy: Any, scores: object) -> torch.Tensor:
    """Prefill ``context_ids`` into ``cache`` with ``policy.measured = scores`` for that call, then
    remove the cache's evictor; returns the context's last logits ``[batch, vocab]``."""
    from kvlib.transformers_compat import cache_argument

    policy.measured = scores
    try:
        with torch.no_grad():
            logits = model(input_ids=context_ids, **cache_argument(cache), logits_to_keep=1).logits[:, -1]
    finally:
        policy.measured = None
    cache.evictor = None
    return logits
