"""kvlib: pluggable KV-cache management for transformer inference.

One paged KV store (:class:`PagedStore`), a registry of policies (:func:`register`,
:func:`available_policies`, :func:`parse_spec`) and adapters that put them to work:
:func:`make_cache` gives ``model.generate`` a :class:`KVCache`, and :class:`Engine` serves many
requests at once (continuous batching with chunked prefill, preemption and prefix reuse).
"""

from kvlib.adapters import Engine, KVCache, attach, blend_cache, make_cache
from kvlib.adapters.cache.chunk_store import ChunkStore
from kvlib.codec import Field, FitSample, PageCodec, TensorCodec, TensorShape
from kvlib.errors import DiskTierUnavailable, PoolExhaustedError, RemoteAccessDenied, SpecError
from kvlib.policy import Budget, CheckpointProjection, Eviction, LayerView, LowRank, Policy, Quantization, Recompute, Reuse, Tiering
from kvlib.registry import available_policies, available_strategies, get_policy, get_strategy, register
from kvlib.spec import Spec, parse_spec
from kvlib.spec_text import parse_policy
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.prefix.prefix_store import PrefixStore
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "CheckpointProjection",
    "ChunkStore",
    "DiskTierUnavailable",
    "Engine",
    "Eviction",
    "Field",
    "FitSample",
    "KVCache",
    "LayerRead",
    "LayerView",
    "LowRank",
    "PageCodec",
    "PagedStore",
    "PrefixStore",
    "PoolExhaustedError",
    "RemoteAccessDenied",
    "Quantization",
    "Recompute",
    "Reuse",
    "Spec",
    "SpecError",
    "StoreConfig",
    "Policy",
    "TensorCodec",
    "TensorShape",
    "Tiering",
    "attach",
    "available_policies",
    "available_strategies",
    "blend_cache",
    "get_policy",
    "get_strategy",
    "make_cache",
    "parse_spec",
    "parse_policy",
    "register",
]


_DEPRECATED = {"Strategy": "Policy", "parse_strategy": "parse_policy"}
"""Names of 0.1 (which said "strategy" for a registered plugin), kept for one release."""


def __getattr__(name: str):
    """The deprecated names of :data:`_DEPRECATED`, with a ``DeprecationWarning``."""
    if name in _DEPRECATED:
        import warnings

        warnings.warn(f"kvlib.{name} is deprecated: use kvlib.{_DEPRECATED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_DEPRECATED[name]]
    raise AttributeError(f"module 'kvlib' has no attribute {name!r}")
