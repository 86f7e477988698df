"""``RecomputedKVCacheLayer``: a KV layer that stores each token's checkpoint (the attention module's
input) instead of its keys and values, and recomputes them whenever the layer is read
(a :class:`~kvlib.policy.Recompute` policy: ``kv_direct``).

Storage: the layer's pages hold one row per token (the store is built with one "head" per layer,
:func:`checkpoint_shape`): its checkpoint's first ``ceil(dim / 2)`` channels as the row's key, the
rest as its value, in the compute dtype, with the position id the model gave the token. So a
token costs ``dim`` channels per layer (plus its position), where keys and values cost ``2 *
kv_heads * head_dim``; ``memory_report`` counts what the pages hold, and its
``full_equivalent_bytes`` what the model's keys and values would (``stored_tokens`` counts one
checkpoint per token and layer).

A call (``update``): the attention module's forward pre-hook hands the layer the call's
checkpoints and position ids (:meth:`record_checkpoint`, :func:`~kvlib.adapters.cache.model_hooks.attach`
with ``checkpoints=True``); ``update`` stores them and returns, as ``DynamicCache.update`` does,
every token the layer holds: the tokens of earlier calls recomputed from their checkpoints by the
policy's :class:`~kvlib.policy.CheckpointProjection`, then the call's own keys and values as the
model computed them. The model's own attention runs over them (its attention is not routed
through kvlib, as for a dense cache: no step is planned, nothing follows the attention), so
outputs are the exact cache's to float rounding. The recomputed keys and values are a transient
copy of the layer, freed when the model drops them (``DynamicCache`` concatenates its whole
layer at every step too); the read of the checkpoints is the store's workspace
(``peak_workspace_bytes``).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.adapters.cache.compiled_calls import NOT_COMPILED
from kvlib.adapters.cache.shared_state import SharedState
from kvlib.model_shape import KVShape
from kvlib.policy import CheckpointProjection


def checkpoint_shape(shape: KVShape, projections: list[CheckpointProjection]) -> KVShape:
    """The store layout of checkpoints for a model of ``shape``: one row per token and layer, the
    checkpoint split between its key (``ceil(dim / 2)`` channels) and value (the rest)."""
    layers = shape.num_layers
    return dataclasses.replace(
        shape,
        layer_kv_heads=(1,) * layers,
        layer_query_heads=(1,) * layers,
        layer_head_dims=tuple((p.dim + 1) // 2 for p in projections),
        layer_value_dims=tuple(p.dim // 2 for p in projections),
    )


class RecomputedKVCacheLayer(KVCacheLayer):
    """A KV layer holding checkpoints, returning recomputed keys and values (see the module
    docstring). Invariants: every row holds every token seen, one checkpoint each, in the order
    the calls gave them (nothing is evicted); each call's checkpoints are recorded before its
    ``update`` and used by it once."""

    def __init__(self, cache: SharedState, layer_idx: int, module_layer: int | None) -> None:
        super().__init__(cache, layer_idx, module_layer)
        self.checkpoint: torch.Tensor | None = None
        """This call's attention input ``[batch, tokens, dim]``, until ``update`` stores it."""
        self.positions: torch.Tensor | None = None
        """This call's position ids ``[batch, tokens]`` (None: the model gave none)."""

    def record_checkpoint(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Keep this call's attention input and position ids for its ``update``."""
        self.checkpoint, self.positions = hidden_states, position_ids

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the call's checkpoints; return every token the layer holds (``[batch, kv_heads,
        seen, dim]``): earlier calls' keys and values recomputed, then this call's ``key_states``
        and ``value_states``. ``RuntimeError`` when no checkpoint was recorded for the call (the
        model was called without the cache's hooks: make the cache with :func:`kvlib.make_cache`)."""
        if torch.compiler.is_compiling():
            raise ValueError(NOT_COMPILED.format(what="runs over keys and values recomputed from checkpoints (kv_direct)"))
        checkpoint, positions = self.checkpoint, self.positions
        self.checkpoint = self.positions = None
        if checkpoint is None or checkpoint.shape[:2] != (key_states.shape[0], key_states.shape[2]):
            raise RuntimeError(
                f"layer {self.layer_idx} got keys and values without the checkpoint they were computed from;"
                " a kv_direct cache records it by a hook kvlib.make_cache adds to the model's attention modules"
            )
        cache = self.cache
        cache.start_call(self.layer_idx, key_states)
        batch, tokens = checkpoint.shape[:2]
        if positions is None:
            positions = torch.arange(self.seen, self.seen + tokens, device=checkpoint.device).expand(batch, tokens)
        half = (checkpoint.shape[-1] + 1) // 2
        rows = checkpoint.unsqueeze(1)
        cache.store.append(self.layer_idx, cache.rows, rows[..., :half], rows[..., half:], positions.expand(batch, tokens))
        earlier = self.seen
        self.seen += tokens
        if earlier == 0:
            return key_states, value_states
        read = cache.store.read(self.layer_idx, cache.rows, mirror=False)
        stored = torch.cat([read.keys[:, 0, :earlier], read.values[:, 0, :earlier]], dim=-1)
        keys, values = cache.projections[self.layer_idx].keys_values(stored, read.positions[:, 0, :earlier].to(stored.device))
        return torch.cat([keys, key_states], dim=2), torch.cat([values, value_states], dim=2)

    def reset(self, seen: int = 0) -> None:
        super().reset(seen)
        self.checkpoint = self.positions = None
