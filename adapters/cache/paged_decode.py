"""The kvlib SDPA attention function's paths for a call that reads the layer's pages in place.

:meth:`KVCacheLayer.update <kvlib.adapters.cache.cache_layer.KVCacheLayer.update>` stores a few new
tokens (a decode step, assisted decoding's candidates) and hands over the layer's pages
(``LayerStep.paged``) instead of a dense read. :func:`attention_over_pages` then gives what
``transformers``' SDPA attention gives over the dense layer: the model's mask over logical
positions is looked up at each stored token's position, so padding, sliding windows and chunked
masks hold; ``scaling`` is the module's; grouped-query heads share their KV head's pages. A decode
step planned for every layer (``LayerStep.plan``) attends through its plan instead
(:func:`planned_attention`).
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.shared_state import SharedState
from kvlib.adapters.runtime.compressor import PlannedWork
from kvlib.adapters.runtime.layer_step import AttentionCall, LayerStep
from kvlib.adapters.runtime.masks import allowed, real_new_tokens
from kvlib.devices import host_readable


def attention_over_pages(
    query: torch.Tensor, attention_mask: torch.Tensor | None, step: LayerStep, kwargs: dict
) -> tuple[torch.Tensor, None]:
    """SDPA's output for ``query`` (``[batch, query_heads, queries, head_dim]``) over the pages
    of ``step``, laid out as transformers' attention functions return it (``[batch, queries,
    query_heads, value_dim]``), then the step's after-attention work."""
    batch, _, queries, head_dim = query.shape
    if attention_mask is None:  # SDPA's causal shortcut: causal in the logical positions
        visible, query_positions = None, step.query_offset + torch.arange(queries)
    else:
        visible, query_positions = allowed(attention_mask)[:, 0].expand(batch, -1, -1), None
    scale = kwargs.get("scaling") or head_dim**-0.5
    output = step.paged.attend(query, visible=visible, query_positions=query_positions, scale=scale)
    step.owner.after_attention(
        step, query=query, mask=attention_mask, weights=None, real_new=real_new_tokens(attention_mask, step), scaling=scale
    )
    return output.transpose(1, 2).contiguous(), None


def planned_attention(cache: SharedState, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, None]:
    """A planned step's attention straight over the layer's pages (the store's paged kernel
    through the plan), the attention each stored token received added by the kernel itself into
    the compressor's accumulated attention where it adds it up (:attr:`PlannedWork.ACCUMULATE`:
    no operator of its own), then the step's after-attention work; the real new tokens are found
    once per step, at layer 0 (``cache.step_real_new``)."""
    layer_idx, query, mask, plan = step.layer_idx, call.query, call.attention_mask, step.plan
    scale = call.kwargs.get("scaling") or query.shape[-1] ** -0.5
    received = None
    if cache.plan_work and cache.plan_work[layer_idx] is PlannedWork.ACCUMULATE:
        slots = int(cache.store.tables[layer_idx].lengths_np[plan.rows_np].max())
        received = cache.compressor.received_state(layer_idx, *plan.lengths.shape[1:], slots, plan.lengths.device)
    output = plan.pools[layer_idx].format.attend_planned(plan, layer_idx, query, mask, scale, received=received)
    if layer_idx == 0 and not cache.plan_known_real:
        real_new = real_new_tokens(mask, step)
        if real_new is not None and not host_readable(real_new):  # counted on the device, not looked at: no sync
            cache.padding += (~real_new).sum(-1)
        elif real_new is not None and not bool(real_new.all()):
            cache.step_real_new = real_new
    step.owner.after_attention(step, query=query, mask=mask, weights=None, real_new=cache.step_real_new, scaling=scale)
    return output, None
