"""``DenseKVCacheLayer``: a KV layer of a model that attends over what the cache returns, outside
kvlib; ``IndexedKVCacheLayer``: one that also keeps a sparse-attention indexer's keys.

Some `transformers` models compute attention themselves instead of calling a function registered
in ``AttentionInterface`` (Bloom and Falcon with ALiBi or their own kernels, MPT, GPT-Neo, XGLM,
CPM-Ant, BigBird, GIT); multi-head latent attention expands the cached latent into keys and values
after ``update``; a sparse-attention indexer (DeepSeek V3.2, GLM MoE DSA) picks the tokens attention
reads from keys of its own: kvlib's attention never runs over what the cache returns, so a layer
cannot hand its attention the pages. Their cache is served densely instead, as ``DynamicCache`` serves it: each
call's keys and values are stored in the layer's pages, and ``update`` returns the layer's keys
and values read back from the pages, in position order (``[batch, kv_heads, seen, dim]``), which
the model's own attention runs over. The read is a transient copy (``DynamicCache`` copies its
whole layer at every step too, by concatenation); no dense mirror is kept.

The KV layout of a model outside ``AttentionInterface`` is taken from its first call
(:meth:`KVCache.measure_layout <kvlib.adapters.cache.transformers_cache.KVCache.measure_layout>`):
such models lay their cache out their own way. Exact, like the paged layers: the read equals
what ``DynamicCache.update`` returns. Nothing
follows the attention (kvlib never sees it), so eviction, which needs the call's attention, is
refused for these models (``make_cache`` checks), and no decode step is planned.
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.adapters.cache.shared_state import SharedState


class DenseKVCacheLayer(KVCacheLayer):
    """A KV layer whose ``update`` returns the layer's stored keys and values, read densely (see the
    module docstring). Invariant: every row holds every token seen (nothing is evicted), so the
    read spans ``seen`` slots in position order, padding included, as ``DynamicCache`` holds it."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the call's keys and values (``[batch, kv_heads, tokens, dim]``) and return every
        token the layer holds, this call's included: the call's own tensors where the layer held
        nothing before, else a dense read of its pages."""
        cache = self.cache
        if cache.store is None and cache.measures_layout:
            cache.measure_layout(key_states, value_states)
        cache.start_call(self.layer_idx, key_states)
        first_tokens = self.seen == 0
        cache.store.append(self.layer_idx, cache.rows, key_states, value_states)
        self.seen += key_states.shape[2]
        if first_tokens:
            return key_states, value_states
        read = cache.store.read(self.layer_idx, cache.rows, mirror=False)
        return read.keys, read.values


class IndexedKVCacheLayer(DenseKVCacheLayer):
    """A dense KV layer that also keeps the indexer keys of a sparse-attention layer (DSA:
    ``cache.update_indexer``), ``[batch, tokens, index_head_dim]``, and the positions a model may
    file beside them (``indexer_position_ids``, ``[position_dims, batch, tokens]``: Qwen4-Exp's),
    as ``DynamicCache``'s indexed layer keeps them: tensors grown by concatenation, their rows
    following the cache's rows (:func:`~kvlib.adapters.cache.state_layers.select_state_rows`),
    dropped by ``reset``."""

    def __init__(self, cache: SharedState, layer_idx: int, module_layer: int | None) -> None:
        super().__init__(cache, layer_idx, module_layer)
        self.indexer_keys: torch.Tensor | None = None
        self.indexer_position_ids: torch.Tensor | None = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append the call's indexer keys (``[batch, tokens, index_head_dim]``); returns every one held."""
        held = self.indexer_keys
        self.indexer_keys = indexer_key_states if held is None else torch.cat([held, indexer_key_states], dim=1)
        return self.indexer_keys

    def reset(self, seen: int = 0) -> None:
        super().reset(seen)
        self.indexer_keys = self.indexer_position_ids = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :tokens_to_remove]
        if tokens_to_remove < 0 and self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids[..., :tokens_to_remove]
