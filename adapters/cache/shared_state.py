"""What a :class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer` and the helpers doing its work
(:mod:`.layer_tiering`, :mod:`.sliding_window`, :mod:`.paged_decode`) read of the cache that holds
it: the state its layers share (:class:`~kvlib.adapters.KVCache` is the one implementation)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvlib.adapters.cache.prefix_session import PrefixSession
from kvlib.adapters.runtime.compressor import Compressor, PlannedWork
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.codec import PageCodec
from kvlib.model_shape import KVShape
from kvlib.policy import CheckpointProjection, Tiering
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.step_plan import StepPlan


class PrefillRecorder(Protocol):
    """What records a prompt call's after-attention inputs (:class:`kvlib.adapters.cache.shared_prefill.PrefillRecorder`)."""

    def observe(self, layer: int, step: LayerStep, **inputs: object) -> None: ...

    def hidden(self, layer: int, hidden_states: torch.Tensor) -> None: ...


class PendingLayer(Protocol):
    """What a layer reads of another layer of its cache: the step that layer published whose
    attention has not run yet (None once it ran)."""

    pending: LayerStep | None


class SharedState(Protocol):
    """The state a cache's layers share. A layer changes ``padding`` (layer 0 counts it),
    ``prepared`` (layer 0 clears it) and ``step_real_new`` (layer 0's planned attention finds it),
    nothing else of it."""

    shape: KVShape
    store: PagedStore
    rows: list[int]
    padding: torch.Tensor
    compressor: Compressor | None
    codecs: list[PageCodec | None] | None
    tiering: Tiering | None
    session: PrefixSession | None
    recompute: torch.Tensor | None
    projections: list[CheckpointProjection] | None
    read_cache: bool
    reuse_slots: bool
    compileable: bool
    dense_returns: str | None
    kv_layers: list[PendingLayer]
    plan: StepPlan | None
    plan_known_real: bool
    plan_work: tuple[PlannedWork, ...]
    plan_idle: tuple[bool, ...]
    step_real_new: torch.Tensor | None
    prepared: bool

    def prepare_step(self, tokens: int, attention_mask: torch.Tensor | None = None, *, mask_known: bool = True) -> None: ...

    def start_call(self, layer_idx: int, key_states: torch.Tensor) -> None: ...

    @property
    def measures_layout(self) -> bool: ...

    def measure_layout(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...

    def serve_densely(self, reason: str, complete: bool, *, shapes_kept: bool) -> None: ...
