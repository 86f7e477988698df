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

A call: the attention module's forward pre-hook hands the layer the call's checkpoints and
position ids (:meth:`record_checkpoint`, from :func:`~kvlib.adapters.cache.model_hooks.attach` with
``checkpoints=True``; inside a compiled forward through one ``kvlib::record_checkpoint`` operator,
so that it runs, in order, when the graph runs); ``update`` stores them and returns, as
``DynamicCache.update`` does, every token the layer holds: the tokens of earlier calls recomputed
from their checkpoints by the policy's :class:`~kvlib.policy.CheckpointProjection`, then the call's
own keys and values as the model computed them. The step travels to kvlib's attention function,
which runs the model's attention (SDPA or eager) over them with the model's mask; nothing follows
the attention (no eviction, no codec), and no decode step is planned. Inside a compiled forward
``update`` and attention are the cache's two operators (:mod:`~kvlib.adapters.cache.compiled_calls`),
their bodies this eager work. Outputs are the exact cache's to float rounding. The recomputed keys
and values are a transient copy of the layer, freed after the call's attention (``DynamicCache``
concatenates its whole layer at every step too); the read of the checkpoints is the store's
workspace (``peak_workspace_bytes``).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.adapters.cache.cache_layer import KVCacheLayer
from kvlib.adapters.cache.compiled_calls import handled_cache
from kvlib.adapters.cache.shared_state import SharedState
from kvlib.adapters.runtime.layer_step import AttentionCall, LayerStep
from kvlib.model_shape import KVShape
from kvlib.policy import CheckpointProjection
from kvlib.storage.layers.read_cache import LayerRead


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
    """A KV layer holding checkpoints, attending over recomputed keys and values (see the module
    docstring). Invariants: every row holds every token seen, one checkpoint each, in the order
    the calls gave them (nothing is evicted, slots are positions); each call's checkpoints are
    recorded before its ``update`` and used by it once."""

    def __init__(self, cache: SharedState, layer_idx: int, module_layer: int | None) -> None:
        super().__init__(cache, layer_idx, module_layer)
        self.checkpoint: torch.Tensor | None = None
        """This call's attention input ``[batch, tokens, dim]``, until ``update`` stores it."""
        self.positions: torch.Tensor | None = None
        """This call's position ids ``[batch, tokens]`` (None: the model gave none)."""

    def record_checkpoint(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Keep this call's attention input and position ids for its ``update``."""
        self.checkpoint, self.positions = hidden_states, position_ids

    def store_call(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerStep:
        """Store the call's checkpoints; the step holds every token of the layer (``[batch,
        kv_heads, seen, dim]``): earlier calls' keys and values recomputed, then ``key_states`` and
        ``value_states``. ``RuntimeError`` when no checkpoint was recorded for the call (the model
        runs without the cache's hooks: make the cache with :func:`kvlib.make_cache`)."""
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
            positions = torch.arange(self.seen, self.seen + tokens, device=checkpoint.device)
        half = (checkpoint.shape[-1] + 1) // 2
        rows = checkpoint.unsqueeze(1)
        cache.store.append(self.layer_idx, cache.rows, rows[..., :half], rows[..., half:], positions.expand(batch, tokens))
        earlier = self.seen
        self.seen += tokens
        keys, values = key_states, value_states
        if earlier:
            read = cache.store.read(self.layer_idx, cache.rows, mirror=False)
            stored = torch.cat([read.keys[:, 0, :earlier], read.values[:, 0, :earlier]], dim=-1)
            old_keys, old_values = cache.projections[self.layer_idx].keys_values(stored, read.positions[:, 0, :earlier].to(stored.device))
            keys, values = torch.cat([old_keys, key_states], dim=2), torch.cat([old_values, value_states], dim=2)
        slots = torch.arange(self.seen, device=keys.device).expand(batch, keys.shape[1], self.seen)
        read = LayerRead(keys, values, slots, torch.ones_like(slots, dtype=torch.bool))
        return LayerStep(self, self.layer_idx, read, earlier, tokens, identity=True)

    def attend(self, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's attention over the step's keys and values, with its mask (slots are
        positions); nothing follows it."""
        step.attended = True
        return call.run_inner(step.read.keys, step.read.values, call.attention_mask)

    def reset(self, seen: int = 0) -> None:
        super().reset(seen)
        self.checkpoint = self.positions = None


_LIBRARY = torch.library.Library("kvlib", "FRAGMENT")  # noqa: TOR901 - the low-level API, as compiled_calls' operators
_LIBRARY.define(
    "record_checkpoint(Tensor(a!) handle, int layer, Tensor hidden_states, Tensor? position_ids) -> ()",
    tags=(torch.Tag.cudagraph_unsafe,),
)


def _record(handle: torch.Tensor, layer: int, hidden_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    handled_cache(handle).record_checkpoint(layer, hidden_states, position_ids)


_LIBRARY.impl("record_checkpoint", _record, "CompositeExplicitAutograd")
torch.library.register_fake("kvlib::record_checkpoint", lambda *args: None, lib=_LIBRARY)


def record_checkpoint(cache: object, layer_idx: int, hidden_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    """Hand model layer ``layer_idx``'s attention input and position ids to ``cache`` (a
    :class:`~kvlib.adapters.KVCache`): directly, or, inside a forward being compiled, as one
    ``kvlib::record_checkpoint`` operator whose body does it when the graph runs (before the
    layer's ``kvlib::cache_update``, which reads them)."""
    if torch.compiler.is_compiling():
        torch.ops.kvlib.record_checkpoint(cache.handle, layer_idx, hidden_states, position_ids)
    else:
        cache.record_checkpoint(layer_idx, hidden_states, position_ids)
