"""A :class:`~kvlib.adapters.cache.transformers_cache.KVCache`'s decode step planned for every layer
at once, before the forward runs (what :meth:`KVCache.prepare_step
<kvlib.adapters.cache.transformers_cache.KVCache.prepare_step>` does).

:func:`plan_decode_step` asks the paged store for one plan of the coming call (a
:class:`~kvlib.storage.store.step_plan.StepPlan`: see :mod:`kvlib.storage.store.step_plan`) and works out,
per layer, what follows its attention: the evictor's planned work
(:class:`~kvlib.adapters.runtime.evictor.PlannedWork`) and whether nothing at all follows (no
eviction work beyond the attention the kernel adds up itself, no page to seal, no window to slide past, no prompt pages to index), so that an
idle layer's update and attention keep no books of their own.

No plan (the step goes layer by layer): more than
:data:`~kvlib.adapters.cache.cache_layer.PAGED_QUERY_TOKENS` new tokens, a model attending over
dense reads outside kvlib (:mod:`~kvlib.adapters.cache.dense_layer`), a layer holding nothing
yet, a layer whose ``update`` must return every stored token (not checked yet, or a model that
does more with them than attend: :attr:`KVCacheLayer.returns_new_tokens`), padding among the new tokens, a read mirror, a device whose attention cannot read pages in
place, tiering, a selective recompute, a held cap compacted at every step (no slack, not a ring),
or a store with no plan for these rows.

The result is one object, :class:`PlannedDecode` (the store's plan and, per layer, what follows
its attention), or None; of the cache only ``padding`` is written (a device mask's padding tokens
among the new ones, counted on the device).
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.cache_layer import PAGED_QUERY_TOKENS
from kvlib.adapters.cache.planned_decode import PlannedDecode
from kvlib.adapters.cache.shared_state import SharedState
from kvlib.adapters.runtime.evictor import PlannedWork
from kvlib.adapters.runtime.masks import allowed
from kvlib.devices import host_readable, reads_pages_in_place
from kvlib.storage.store.step_plan import StepPlan


def plan_decode_step(cache: SharedState, tokens: int, attention_mask: torch.Tensor | dict | None, mask_known: bool) -> PlannedDecode | None:
    """The plan of ``cache``'s coming call of ``tokens`` new tokens per row, or None (see the
    module docstring); ``attention_mask``: the call's mask (see :func:`_new_tokens_real`), or None:
    no padding; ``mask_known`` False: whether the new tokens are real is read later, from the mask
    layer 0's attention gets."""
    first = cache.kv_layers[0].seen
    if (
        tokens > PAGED_QUERY_TOKENS
        or cache.dense
        or first == 0
        or cache.read_cache
        or cache.tiering is not None
        or cache.recompute is not None
        or not cache.rows
        or not reads_pages_in_place(cache.store.device)
        or any(layer.seen != first or not layer.returns_new_tokens for layer in cache.kv_layers)
    ):
        return None
    padding = None
    if attention_mask is not None:
        real = _new_tokens_real(attention_mask, tokens, first)
        if real is False:
            return None  # padding among the new tokens: the general path drops it
        padding = None if real is True else real
        mask_known = True
    ring = None
    if cache.evictor is not None:
        ring = cache.evictor.ring(len(cache.rows), cache.shape.layer_kv_heads[0]) if cache.reuse_slots else None
        if ring is None and cache.evictor.compacts_each_step(tokens):
            return None
    plan = cache.store.plan_step(cache.rows, tokens, ring)
    if plan is None:
        return None
    if padding is not None:
        cache.padding += padding
    work = tuple(_work_after(cache, plan, layer, tokens, mask_known) for layer in range(cache.shape.num_layers))
    idle = tuple(work is not PlannedWork.GENERAL and not _keeps_books_after(cache, plan, layer) for layer, work in enumerate(work))
    return PlannedDecode(plan, mask_known, work, idle)


def _new_tokens_real(attention_mask: torch.Tensor | dict, tokens: int, seen: int) -> bool | torch.Tensor:
    """Whether the coming call's ``tokens`` new tokens are all real, from the call's mask: 2-D
    (``[batch, seen + tokens]``), 4-D over logical positions, or a dict of 4-D masks per layer
    type (what ``generate`` builds for a compileable cache): a new token is padding where the
    mask hides it from itself. A mask on a device is not read on the host (that would be a
    sync): for it, the padding tokens of each row (int64 ``[batch]``, on the device), which the
    planned step adds to the rows' padding, storing the tokens as real."""
    mask = next(iter(attention_mask.values())) if isinstance(attention_mask, dict) else attention_mask
    if mask.dim() == 2:
        real = mask[:, -tokens:].bool()
    else:
        steps = torch.arange(tokens, device=mask.device)
        real = allowed(mask)[:, 0, steps, (seen + steps).clamp(max=mask.shape[-1] - 1)]
    if not host_readable(real):
        return (~real).sum(-1)
    return bool(real.all())


def _work_after(cache: SharedState, plan: StepPlan, layer: int, tokens: int, mask_known: bool) -> PlannedWork:
    """What the evictor does after this planned step's attention in ``layer``."""
    evictor = cache.evictor
    if evictor is None:
        return PlannedWork.NONE
    codec = cache.codecs[layer] if cache.codecs is not None else None
    if not mask_known or (codec is not None and codec.uses_salience):
        return PlannedWork.GENERAL
    return evictor.planned_work(layer, tokens, cache.store.tables[layer].lengths_np[plan.rows_np])


def _keeps_books_after(cache: SharedState, plan: StepPlan, layer: int) -> bool:
    """Whether ``layer`` has pages to seal after this planned step, slides past its window, or
    is the last layer of a cache whose prompt pages a prefix session indexes."""
    if cache.session is not None and layer == cache.shape.num_layers - 1:
        return True
    if cache.kv_layers[layer].slides(plan.tokens):
        return True
    if cache.codecs is None or cache.codecs[layer] is None:
        return False
    table, rows = cache.store.tables[layer], plan.rows_np
    return bool((table.lengths_np[rows] // table.page_size > table.sealed_np[rows]).any())
