"""The kvlib SDPA attention function's path for a call that reads the layer's pages in place.

:meth:`KVCacheLayer.update <kvlib.adapters.cache.cache_layer.KVCacheLayer.update>` stores a few new
tokens (a decode step, assisted decoding's candidates) and hands over the layer's pages
(``LayerStep.paged``) instead of a dense read. :func:`attention_over_pages` then gives what
``transformers``' SDPA attention gives over the dense layer: the model's mask over logical
positions is looked up at each stored token's position, so padding, sliding windows and chunked
masks hold; ``scaling`` is the module's; grouped-query heads share their KV head's pages.
"""

from __future__ import annotations

import torch

from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.masks import allowed, real_new_tokens


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
    step.after_attention(query=query, mask=attention_mask, weights=None, real_new=real_new_tokens(attention_mask, step), scaling=scale)
    return output.transpose(1, 2).contiguous(), None
