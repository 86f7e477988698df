"""Attention of a sparse decode step: over the pages the query chooses, not the whole layer.

With ``quest`` a decode step's ``KVCache.update`` stores the new token but reads nothing back:
the pages worth attending over depend on the query, which only the attention function sees.
(:func:`sparse_decode_attention`) asks the step's cache layer which pages the query chooses and attends over
them where they lie, through the page kernel with a block table restricted to them
(:func:`~kvlib.adapters.cache.paged_decode.attention_over_pages`: the model's mask looked up at each
stored token's position). Where the kernel does not apply (eager attention, attention sinks, a
pool or device that cannot read pages in place) the chosen pages are read into a dense copy
instead, the model's mask moved onto their slots, and the inner attention runs over them. Either
way the result equals full attention restricted to the chosen pages' tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.adapters.cache.paged_decode import attention_over_pages
from kvlib.adapters.runtime.layer_step import AttentionCall, LayerStep, paged_attention_applies
from kvlib.adapters.runtime.masks import physical_mask, real_new_tokens


def sparse_decode_attention(call: AttentionCall, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``call.query [batch, query_heads, 1, head_dim]`` over the pages ``step``'s
    owner chooses for it, through the page kernel or ``call``'s inner attention (SDPA or eager)
    over a dense copy of them; then the step's after-attention work."""
    owner, query, attention_mask = step.owner, call.query, call.attention_mask
    selection = owner.choose_pages(query)
    if not call.eager and paged_attention_applies(call.kwargs):
        paged = owner.chosen_pages(selection)
        if paged is not None:
            return attention_over_pages(query, attention_mask, dataclasses.replace(step, paged=paged), call.kwargs)
    read = owner.read_chosen_pages(selection)
    chosen = dataclasses.replace(step, read=read, identity=False)
    mask = physical_mask(attention_mask, chosen, query.shape[1], call.float_mask_dtype)
    output, weights = call.run_inner(read.keys, read.values, mask)
    step.owner.after_attention(
        step, query=query, mask=mask, weights=weights, real_new=real_new_tokens(attention_mask, step), scaling=call.kwargs.get("scaling")
    )
    return output, weights
