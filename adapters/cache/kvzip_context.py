"""A KVzip-compressed context held whole in a :class:`~kvlib.PrefixStore` and forked for each question.

:func:`compressed_context` is where KVzip (:mod:`kvlib.policies.eviction.kvzip`: the policy
and its :func:`~kvlib.policies.eviction.kvzip.compress`) meets the drop-in cache and the
prefix store: it builds a cache with :func:`kvlib.make_cache`, so it sits in the adapters' layer,
above the policies and the store it puts together.
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.make_cache import make_cache
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.policies.eviction.kvzip import RepeatPrompt, compress
from kvlib.storage.prefix.prefix_store import PrefixStore


def compressed_context(
    model: torch.nn.Module,
    reuse: PrefixStore,
    context_ids: torch.Tensor,
    prompt: RepeatPrompt,
    *,
    budget: int | float,
    spec: str = "kvzip",
    **options: object,
) -> KVCache:
    """A cache holding ``context_ids`` (int ``[batch, tokens]``, no padding) compressed by KVzip,
    ready for a question: ``generate(torch.cat([context_ids, question], 1), cache=...)`` then
    reads the question only.

    The first call for a context compresses it (:func:`compress`: two prefills and the
    reconstruction passes) and holds a fork of the result in ``reuse``
    (:attr:`~kvlib.PrefixStore.contexts`, in memory, within its ``capacity_bytes``); later calls
    for the same model, spec, budget, options, reconstruction prompt and context ids get a fork
    of it (pages shared, copy-on-write) and compute nothing. Each returned cache is the caller's
    own: what it appends (a question, an answer) never reaches the held one or another fork.

    ``spec``, ``budget`` and ``options`` are :func:`kvlib.make_cache`'s (``spec`` must put KVzip
    first); everything is checked before the model runs.
    """
    if not isinstance(reuse, PrefixStore):
        raise ValueError(f"reuse must be a kvlib.PrefixStore, got {type(reuse).__name__}")
    if not reuse.identity.matches(model):
        raise ValueError("this PrefixStore was built for another model (config or weights differ)")
    cache = make_cache(model, spec, budget=budget, **options)
    parameter = next(model.parameters())
    shaped = f"{cache.spec}|budget={budget!r}|{sorted(options.items())!r}|{prompt!r}"  # the whole spec: codec and allocation too
    key = reuse.context_key(reuse.namespace(shaped, parameter.dtype, parameter.device, cache.page_size), context_ids)
    held = reuse.contexts.fork(key)
    if held is not None:
        return held
    compress(model, cache, context_ids, prompt)
    reuse.contexts.hold(key, cache)
    return cache
