"""The hand-off between ``KVCache.update`` and the kvlib attention function of the same layer call.

A `transformers` attention layer calls ``cache.update(k, v, layer_idx)`` and then, at once, its
attention function with the tensors ``update`` returned. The cache publishes a :class:`LayerStep`
(in a context variable, so threads and async tasks never see each other's steps); the kvlib
attention function takes it back only if it is for the same layer and the same key tensor
object. Attention over anything else (another cache class, cross-attention) finds no step and
runs unchanged.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
    """

    cache: KVCache
    layer_idx: int
    read: LayerRead
    query_offset: int
    query_length: int
    identity: bool
    query_positions: torch.Tensor | None = None
    sparse: bool = False


_active_step: ContextVar[LayerStep | None] = ContextVar("kvlib_active_step", default=None)


def publish(step: LayerStep) -> None:
    """Make ``step`` the one the next attention call of its layer takes."""
    _active_step.set(step)


def take(module: torch.nn.Module, keys: torch.Tensor) -> LayerStep | None:
    """The published step for this attention call, or None if the call is not for it.

    A step is taken at most once: a second attention call with the same tensors finds nothing.
    """
    step = _active_step.get()
    if step is None or step.read.keys is not keys or getattr(module, "layer_idx", None) != step.layer_idx:
        return None
    _active_step.set(None)
    return step
