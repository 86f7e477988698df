"""A :class:`~kvlib.adapters.KVCache`'s layers, one per model layer, as ``DynamicCache(config=...)``
has them: KV layers in kvlib's pages, and the recurrent state of a hybrid model's other layers
kept as transformers keeps it.

- an attention layer is a :class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer`;
- a linear-attention, Mamba or convolution layer (``"linear_attention"``, ``"conv"``) is
  transformers' own ``LinearAttentionLayer``: its convolution and recurrent states are one
  tensor per row each, updated in place by the model, and what the model reads back is exactly
  what ``DynamicCache`` gives it;
- a ``"hybrid"`` layer (Falcon-H1, Zamba2: attention and Mamba in one layer) is a
  :class:`HybridCacheLayer`, both at once;
- an ``"indexed_attention"`` layer (DSA) is an
  :class:`~kvlib.adapters.cache.dense_layer.IndexedKVCacheLayer`, its indexer keys held beside
  its pages (a model with one is served densely);
- a layer with no cache (``"dummy"``: an MLP- or MoE-only layer, a layer reading another
  layer's KV) is transformers' ``DummyLayer``.

Invariant: a state follows its row wherever the cache's rows go (beams, selected and repeated
rows: :func:`select_state_rows`), and is zeroed by ``reset``. Policies (eviction, codecs,
budgets, tiering) act on the KV layers only: a recurrent state is a fixed size whatever the
context, and holds no tokens to evict.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.adapters.cache.dense_layer import IndexedKVCacheLayer
from kvlib.adapters.cache.shared_state import SharedState
from kvlib.model_shape import INDEXED_LAYER_TYPES, KV_LAYER_TYPES, STATE_LAYER_TYPES, KVShape
from kvlib.transformers_compat import DummyLayer


class HybridCacheLayer(LinearAttentionLayer, KVCacheLayer):
    """A ``"hybrid"`` model layer: paged keys and values (:class:`KVCacheLayer`) and a recurrent
    and convolution state (transformers' ``LinearAttentionLayer``), as transformers'
    ``LinearAttentionAndFullAttentionLayer`` holds both. What is a row's moves with the cache's
    rows; ``reset`` and ``crop`` act on both parts."""

    is_compileable = False

    def __init__(self, cache: SharedState, layer_idx: int, module_layer: int | None, number_of_states: int) -> None:
        KVCacheLayer.__init__(self, cache, layer_idx, module_layer)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    @property
    def is_croppable(self) -> bool:
        return LinearAttentionLayer.is_croppable.fget(self) and KVCacheLayer.is_croppable.fget(self)

    def reset(self, seen: int = 0) -> None:
        LinearAttentionLayer.reset(self)
        KVCacheLayer.reset(self, seen)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        KVCacheLayer.crop(self, tokens_to_remove)


def cache_layers(
    cache: SharedState, shape: KVShape, kv_layer_class: type[KVCacheLayer] = KVCacheLayer
) -> tuple[list[object], list[KVCacheLayer]]:
    """``cache``'s layers, one per model layer (what ``transformers`` indexes by ``layer_idx``),
    and its KV layers in KV-layer order (what the store, the evictor and budgets number);
    attention-only layers are ``kv_layer_class``'s."""
    layers: list[object] = []
    kv_layers: list[KVCacheLayer] = []
    for model_layer in range(shape.num_model_layers):
        kind, states = shape.layer_type(model_layer), shape.state_count(model_layer)
        if kind in KV_LAYER_TYPES:
            kv_layer = len(kv_layers)
            module_layer = shape.module_layers[kv_layer]
            if kind in STATE_LAYER_TYPES:
                layer = HybridCacheLayer(cache, kv_layer, module_layer, states)
            elif kind in INDEXED_LAYER_TYPES:
                layer = IndexedKVCacheLayer(cache, kv_layer, module_layer)
            else:
                layer = kv_layer_class(cache, kv_layer, module_layer)
            kv_layers.append(layer)
        elif kind in STATE_LAYER_TYPES:
            layer = LinearAttentionLayer(number_of_states=states)
        else:
            layer = DummyLayer()
        layers.append(layer)
    return layers, kv_layers


UnpagedState = LinearAttentionCacheLayerMixin | IndexedKVCacheLayer
"""A layer keeping state outside kvlib's pages: a recurrent or convolution state, an indexer's keys."""


def state_layers(layers: list[object]) -> list[UnpagedState]:
    """The layers of ``layers`` that keep state outside kvlib's pages."""
    return [layer for layer in layers if isinstance(layer, (LinearAttentionCacheLayerMixin, IndexedKVCacheLayer))]


def select_state_rows(layer: UnpagedState, index: torch.Tensor) -> None:
    """Row ``i`` of ``layer``'s state becomes old row ``index[i]`` (int64 ``[batch]``, CPU); a
    state not yet initialized stays as it is."""
    for states in _state_dicts(layer):
        for name, state in states.items():
            if isinstance(state, torch.Tensor):
                states[name] = state.index_select(0, index.to(state.device))
    if isinstance(layer, IndexedKVCacheLayer):
        if layer.indexer_keys is not None:
            layer.indexer_keys = layer.indexer_keys.index_select(0, index.to(layer.indexer_keys.device))
        if layer.indexer_position_ids is not None:
            layer.indexer_position_ids = layer.indexer_position_ids.index_select(1, index.to(layer.indexer_position_ids.device))


def state_bytes(layers: list[UnpagedState]) -> int:
    """Bytes the states of ``layers`` hold."""
    tensors = [state for layer in layers for states in _state_dicts(layer) for state in states.values()]
    tensors += [
        held for layer in layers if isinstance(layer, IndexedKVCacheLayer) for held in (layer.indexer_keys, layer.indexer_position_ids)
    ]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor))


def _state_dicts(layer: UnpagedState) -> list[dict]:
    """A recurrent-state layer's convolution and recurrent states (none for an indexed layer)."""
    return [layer.conv_states, layer.recurrent_states] if isinstance(layer, LinearAttentionCacheLayerMixin) else []
