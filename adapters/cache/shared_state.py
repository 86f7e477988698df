"""What a cache's layers read of the cache that holds them: the state they share
(:class:`SharedState`; :class:`~kvlib.adapters.KVCache` is the one implementation), the contract
between the cache and its layer classes (:class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer`,
:class:`~kvlib.adapters.cache.dense_layer.DenseKVCacheLayer`, the hybrid models' layers of
:mod:`~kvlib.adapters.cache.state_layers`), so that the cache imports its layers and not the other
way round."""

from __future__ import annotations

from typing import Protocol

import torch

from kvlib.adapters.cache.planned_decode import PlannedDecode
from kvlib.adapters.cache.prefix_session import PrefixSession
from kvlib.adapters.runtime.evictor import Evictor
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.needs import AttentionInputs
from kvlib.codec import PageCodec
from kvlib.model_shape import KVShape
from kvlib.policy import CheckpointProjection, Tiering
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.paged_store import PagedStore


class PrefillRecorder(Protocol):
    """What records a prompt call's after-attention inputs (:class:`kvlib.adapters.cache.shared_prefill.PrefillRecorder`)."""

    def observe(self, layer: int, step: LayerStep, *, inputs: AttentionInputs, stored: LayerRead | None = None) -> None: ...

    def hidden(self, layer: int, hidden_states: torch.Tensor) -> None: ...


class PeerLayer(Protocol):
    """What the cache's layers and its step planning read of one of its KV layers
    (:class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer`)."""

    layer_idx: int
    seen: int
    pending: LayerStep | None
    """The step the layer published whose attention has not run yet (None once it ran)."""

    @property
    def returns_new_tokens(self) -> bool: ...

    def slides(self, tokens: int) -> bool: ...


class SharedState(Protocol):
    """The state a cache's layers share. A layer changes ``padding`` (layer 0 counts it),
    ``prepared`` (layer 0 clears it) and ``planned.real_new`` (layer 0's planned attention finds
    it), nothing else of it."""

    shape: KVShape
    store: PagedStore
    rows: list[int]
    padding: torch.Tensor
    evictor: Evictor | None
    codecs: list[PageCodec | None] | None
    tiering: Tiering | None
    session: PrefixSession | None
    recompute: torch.Tensor | None
    projections: list[CheckpointProjection] | None
    read_cache: bool
    reuse_slots: bool
    compileable: bool
    dense: bool
    dense_returns: str | None
    kv_layers: list[PeerLayer]
    planned: PlannedDecode | None
    prepared: bool

    def prepare_step(self, tokens: int, attention_mask: torch.Tensor | None = None, *, mask_known: bool = True) -> None: ...

    def start_call(self, layer_idx: int, key_states: torch.Tensor) -> None: ...

    @property
    def measures_layout(self) -> bool: ...

    def measure_layout(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...

    def serve_densely(self, reason: str, complete: bool, *, shapes_kept: bool) -> None: ...
