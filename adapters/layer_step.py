"""The hand-off between ``KVCache.update`` and the kvlib attention function of the same layer call.

A `transformers` attention layer calls ``cache.update(k, v, layer_idx)`` and then, at once, its
attention function with the tensors ``update`` returned. The cache publishes a :class:`LayerStep`
that the kvlib attention function of the same call takes back:

- from transformers 5.24 on, attention layers pass their attention keyword arguments to the
  cache (``update(k, v, layer_idx, kwargs=attention_kwargs)``) and then the same dict to the
  attention function (as transformers' own paged cache hands its block table over): the step
  travels in that dict under :data:`STEP_KEYWORD`, from one call to the same call's attention;
- otherwise (older releases, models that pass no kwargs) it waits in a context variable, so
  threads and async tasks never see each other's steps, and is taken only if it is for the same
  layer and the same key tensor object.

Attention over anything else (another cache class, cross-attention) finds no step and runs
unchanged.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlib.paged_attention import PagedLayer
from kvlib.read_cache import LayerRead

if TYPE_CHECKING:
    from kvlib.adapters.transformers_cache import KVCache


@dataclass
class LayerStep:
    """One layer call: the tokens attention will run over and how they map to positions.

    Attributes:
        cache: the cache that stored the step.
        layer_idx: the attention layer.
        read: the layer's stored tokens after the append (physical slots, KV heads).
        query_offset: logical position of the first new token (tokens seen before this call).
        query_length: new tokens in this call (the query length).
        identity: every stored token of every row and head sits at the slot equal to its
            logical position (nothing was ever dropped), so the model's mask applies as it is.
        query_positions: int64 ``[query_length]``, the true positions of a call whose queries
            are scattered tokens already stored (a selective recompute); each attends to the
            stored tokens at or before its position, and the model's mask is not used. None
            for an ordinary call (queries at ``query_offset + i``).
        sparse: a decode step whose attention reads only the pages it chooses by the query
            (``quest``): ``read`` then holds just the call's new tokens (what ``update``
            returned), and the kvlib attention function asks the cache for the chosen pages.
        paged: the layer's tokens where they lie in the pages, for a call whose attention runs
            straight over them (:mod:`~kvlib.paged_attention`); ``read`` then holds just the
            call's new tokens (what ``update`` returned), and no dense copy of the layer exists.
    """

    cache: KVCache
    layer_idx: int
    read: LayerRead
    query_offset: int
    query_length: int
    identity: bool
    query_positions: torch.Tensor | None = None
    sparse: bool = False
    paged: PagedLayer | None = None


STEP_KEYWORD = "kvlib_layer_step"
"""The attention keyword argument that carries a step from ``update`` to attention (5.24+)."""

_active_step: ContextVar[LayerStep | None] = ContextVar("kvlib_active_step", default=None)


def publish(step: LayerStep, attention_kwargs: dict | None = None) -> None:
    """Make ``step`` the one the attention call of its layer takes: put it in the layer call's
    ``attention_kwargs`` when the model passed them to ``update``, else in the context variable."""
    if attention_kwargs is not None:
        attention_kwargs[STEP_KEYWORD] = step
        _active_step.set(None)
    else:
        _active_step.set(step)


def take(module: torch.nn.Module, keys: torch.Tensor, attention_kwargs: dict) -> LayerStep | None:
    """The published step for this attention call, or None if the call is not for it; removes
    :data:`STEP_KEYWORD` from ``attention_kwargs`` (the inner attention never sees it).

    A step is taken at most once: a second attention call with the same tensors finds nothing.
    """
    step = attention_kwargs.pop(STEP_KEYWORD, None)
    if step is None:
        step = _active_step.get()
        if step is None:
            return None
        _active_step.set(None)
    if step.read.keys is not keys or getattr(module, "layer_idx", None) != step.layer_idx:
        return None
    return step
