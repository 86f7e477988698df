"""A :class:`~kvlib.adapters.KVCache`'s layer calls inside a compiled forward: two operators.

``torch.compile`` traces the model's forward; kvlib's bookkeeping (block tables in numpy, pages
allocated and freed, evictions chosen, codecs sealing pages, prefix pages indexed) is host work
that must not be traced. Inside a forward being compiled, a cache layer's ``update`` and the kvlib
attention function of the same call therefore each become one operator, a single node of the
graph whatever the call does:

- ``kvlib::cache_update(handle, layer, keys, values)``: what ``update`` does eagerly (the
  decode step planned at layer 0 where the forward pre-hook did not plan it, the keys and
  values written where the plan or the store puts them, the step published);
- ``kvlib::cache_attend(handle, layer, module, query, ...)``: what the kvlib attention function
  does eagerly with that step (attention over the pages or the layer's stored tokens, then the
  layer's after-attention work: eviction, sealing, ranking, prefix indexing), returning the
  attention output ``[batch, queries, query_heads, value_dim]``.

Their bodies run eagerly when the graph runs; their fake implementations give shapes only, so a
whole forward traces with ``fullgraph=True``, prefill and decode alike, for every policy and
codec. The graph sees a cache through its :attr:`~kvlib.adapters.KVCache.handle` (a 0-d int64
tensor naming it in :data:`_CACHES`) and a model's attention modules through the int keys
:func:`~kvlib.adapters.runtime.attention.route_attention` gave them: no Python object crosses the
operator boundary, so one compiled graph serves every cache of a model and no cache is a compiled
constant. Both operators declare the handle mutated: every kvlib operator of a forward is then
ordered after the previous one, and none is dropped as unused. They are tagged
``cudagraph_unsafe``: their bodies keep books on the host, so a CUDA graph must not hold them
(``mode="reduce-overhead"`` captures the model's operators around them).

The step handed from one operator to the other exists only while tracing (:class:`TracedLayerStep`,
published as the eager step is: in the attention keyword arguments); at run time the operators
find the layer's step through the handle. The forward hooks of :func:`kvlib.attach` do nothing
while traced; each operator checks the calling thread and holds the cache's PrefixStore lock for
its own work (:meth:`~kvlib.adapters.KVCache.enter_call`), where an eager call holds it for the
whole model call.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from kvlib.adapters.runtime import layer_step
from kvlib.adapters.runtime.attention import attention_module, inner_attention
from kvlib.adapters.runtime.layer_step import AttentionCall, LayerStep


class HandledLayer(Protocol):
    """What the operators use of a cache layer (:class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer`)."""

    pending: LayerStep | None

    def store_call(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerStep: ...


class HandledCache(Protocol):
    """What the operators use of a cache (:class:`~kvlib.adapters.KVCache`)."""

    handle: torch.Tensor
    layers: list[HandledLayer]
    dense_returns: str | None

    def enter_call(self, claim: bool = True) -> None: ...

    def leave_call(self) -> None: ...


_CACHES: weakref.WeakValueDictionary[int, HandledCache] = weakref.WeakValueDictionary()
"""Caches by the number their handle holds (held weakly: a cache freed is gone from here)."""
_NUMBERS = itertools.count()


def new_handle(cache: HandledCache) -> torch.Tensor:
    """A handle naming ``cache`` for the operators: a 0-d int64 CPU tensor (read on the host only)."""
    number = next(_NUMBERS)
    _CACHES[number] = cache
    return torch.tensor(number, dtype=torch.int64)


def handled_cache(handle: torch.Tensor) -> HandledCache:
    """The cache ``handle`` names (:func:`new_handle`)."""
    return _CACHES[int(handle)]


_LIBRARY = torch.library.Library("kvlib", "FRAGMENT")  # noqa: TOR901 - the low-level API: a few microseconds a call
_UNSAFE = (torch.Tag.cudagraph_unsafe,)
_LIBRARY.define("cache_update(Tensor(a!) handle, int layer, Tensor keys, Tensor values) -> ()", tags=_UNSAFE)
_LIBRARY.define(
    "cache_attend(Tensor(a!) handle, int layer, int module, Tensor query, Tensor keys, Tensor values, Tensor? mask,"
    " float? scaling, float dropout, float? softcap, int? sliding_window, Tensor? sinks, bool? is_causal, bool eager,"
    " int value_dim) -> Tensor",
    tags=_UNSAFE,
)


def _update(handle: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    cache = handled_cache(handle)
    cache.enter_call()
    try:
        cache.kv_layers[layer].pending = cache.kv_layers[layer].store_call(keys, values)
    finally:
        cache.leave_call()


def _attend(
    handle: torch.Tensor,
    layer: int,
    module: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    softcap: float | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    is_causal: bool | None,
    eager: bool,
    value_dim: int,
) -> torch.Tensor:
    cache = handled_cache(handle)
    step = cache.kv_layers[layer].pending
    attention = attention_module(module)
    kwargs = {"scaling": scaling, "dropout": dropout, "softcap": softcap, "sliding_window": sliding_window, "s_aux": sinks}
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    call = AttentionCall(
        module=attention,
        query=query,
        key=step.read.keys,
        value=step.read.values,
        attention_mask=mask,
        inner=inner_attention("eager" if eager else "sdpa", attention),
        eager=eager,
        kwargs=kwargs,
    )
    cache.enter_call()
    try:
        output, _ = step.attend(call)
    finally:
        cache.leave_call()
    return output.contiguous()


def _attend_fake(
    handle, layer, module, query, keys, values, mask, scaling, dropout, softcap, sliding_window, sinks, is_causal, eager, value_dim
):
    batch, heads, queries, _ = query.shape
    return query.new_empty(batch, queries, heads, value_dim)


_LIBRARY.impl("cache_update", _update, "CompositeExplicitAutograd")
_LIBRARY.impl("cache_attend", _attend, "CompositeExplicitAutograd")
torch.library.register_fake("kvlib::cache_update", lambda *args: None, lib=_LIBRARY)
torch.library.register_fake("kvlib::cache_attend", _attend_fake, lib=_LIBRARY)


@dataclass
class TracedLayerStep:
    """A layer call's step while its forward is traced: published by ``update`` as the eager step
    is, taken by the same call's kvlib attention function, which then traces one
    ``kvlib::cache_attend`` (see the module docstring). ``keys``: what ``update`` returned."""

    handle: torch.Tensor
    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    value_dim: int

    def is_for(self, module: torch.nn.Module, keys: torch.Tensor) -> bool:
        return getattr(module, "layer_idx", None) == self.layer_idx

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, None]:
        """One ``kvlib::cache_attend``; ``ValueError`` while tracing a model whose attention does
        more with what ``update`` returned than attend over it (:meth:`KVCache.serve_densely`
        serves those eagerly only)."""
        mask = call.attention_mask
        if call.key is not self.keys or call.value is not self.values or (mask is not None and mask.dim() == 4 and mask.shape[1] > 1):
            raise ValueError(NOT_COMPILED.format(what="changes the keys, values or mask it gets from the cache before attending"))
        kwargs = call.kwargs
        output = torch.ops.kvlib.cache_attend(
            self.handle,
            self.layer_idx,
            call.module_key,
            call.query,
            call.key,
            call.value,
            call.attention_mask,
            kwargs.get("scaling"),
            float(kwargs.get("dropout") or 0.0),
            kwargs.get("softcap"),
            kwargs.get("sliding_window"),
            kwargs.get("s_aux"),
            kwargs.get("is_causal"),
            call.eager,
            self.value_dim,
        )
        return output, None


def traced_update(
    cache: HandledCache, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, value_dim: int, attention_kwargs: dict | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``update`` while its forward is traced: one ``kvlib::cache_update``, and the
    step published for the call's attention. Returns the call's keys and values as given (the
    operators read the layer's tokens where they lie)."""
    if cache.dense_returns is not None:
        raise ValueError(NOT_COMPILED.format(what=cache.dense_returns))
    if attention_kwargs is None:
        raise ValueError(
            "compiling a model with kvlib's cache needs the model's attention to pass its keyword arguments to"
            " cache.update (kwargs=..., transformers >= 5.24 models do); this one does not: run it without torch.compile"
        )
    torch.ops.kvlib.cache_update(cache.handle, layer_idx, key_states, value_states)
    layer_step.publish(TracedLayerStep(cache.handle, layer_idx, key_states, value_states, value_dim), attention_kwargs)
    return key_states, value_states


NOT_COMPILED = (
    "kvlib cannot compile this model's attention with its cache: the attention {what}, which kvlib serves by"
    " returning every stored token and running eagerly; run the model without torch.compile"
)
