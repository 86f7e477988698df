"""Attention of a sparse decode step: over the pages the query chooses, not the whole layer.

With ``quest`` a decode step's ``KVCache.update`` stores the new token but reads nothing back:
the pages worth attending over depend on the query, which only the attention function sees.
:func:`sparse_decode_attention` asks the cache for the chosen pages (a sparse read of the
store), moves the model's mask onto their slots by stored position, and runs the inner attention
over them. The result equals full attention restricted to the chosen pages' tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvlib.adapters.layer_step import LayerStep
from kvlib.adapters.masks import physical_mask, real_new_tokens


def sparse_decode_attention(
    run: Callable,
    inner: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    step: LayerStep,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``run`` (SDPA or eager, named ``inner``) for ``query [batch, query_heads, 1, head_dim]``
    over the pages ``step.cache`` chooses for it; then hand the step back to the cache."""
    read = step.cache.read_chosen_pages(step.layer_idx, query)
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
