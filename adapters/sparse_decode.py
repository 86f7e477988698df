"""Attention of a sparse decode step: over the pages the query chooses, not the whole layer.

With ``quest`` a decode step's ``KVCache.update`` stores the new token but reads nothing back:
the pages worth attending over depend on the query, which only the attention function sees.
:func:`sparse_decode_attention` asks the cache which pages the query chooses and attends over
them where they lie, through the page kernel with a block table restricted to them
(:func:`~kvlib.adapters.paged_decode.attention_over_pages`: the model's mask looked up at each
stored token's position). Where the kernel does not apply (eager attention, attention sinks, a
pool or device that cannot read pages in place) the chosen pages are read into a dense copy
instead, the model's mask moved onto their slots, and the inner attention runs over them. Either
way the result equals full attention restricted to the chosen pages' tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvlib.adapters.layer_step import LayerStep
from kvlib.adapters.masks import physical_mask, real_new_tokens
from kvlib.adapters.paged_decode import attention_over_pages, paged_attention_applies


def sparse_decode_attention(
    run: Callable,
    inner: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    step: LayerStep,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [batch, query_heads, 1, head_dim]`` over the pages ``step.cache``
    chooses for it, through the page kernel or ``run`` (SDPA or eager, named ``inner``) over a
    dense copy of them; then hand the step back to the cache."""
    selection = step.cache.choose_pages(step.layer_idx, query)
    if inner == "sdpa" and paged_attention_applies(kwargs):
        paged = step.cache.chosen_pages(step.layer_idx, selection)
        if paged is not None:
            return attention_over_pages(query, attention_mask, dataclasses.replace(step, paged=paged), kwargs)
    read = step.cache.read_chosen_pages(step.layer_idx, selection)
    chosen = dataclasses.replace(step, read=read, identity=False)
    float_dtype = None if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask.dtype
    if inner == "eager" and float_dtype is None:
        float_dtype = query.dtype
    mask = physical_mask(attention_mask, chosen, query.shape[1], float_dtype)
    output, weights = run(module, query, read.keys, read.values, mask, **kwargs)
    step.cache.after_attention(
        step, query=query, mask=mask, weights=weights, real_new=real_new_tokens(attention_mask, step), scaling=kwargs.get("scaling")
    )
    return output, weights
