"""kvlib: pluggable KV-cache management for transformer inference.

One paged KV store (:class:`PagedStore`), a registry of strategies (:func:`register`,
:func:`available_policies`, :func:`parse_spec`) and, as they land, adapters that put them to
work in ``model.generate`` and in a continuous-batching scheduler.
"""

from kvlib.errors import PoolExhaustedError, SpecError
from kvlib.paged_store import PagedStore
from kvlib.read_cache import LayerRead
from kvlib.registry import available_policies, get_policy, register
from kvlib.spec import Spec, parse_spec, parse_strategy
from kvlib.strategy import Budget, Eviction, LayerView, LowRank, Quantization, Reuse, Strategy, Tiering

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "Eviction",
    "LayerRead",
    "LayerView",
    "LowRank",
    "PagedStore",
    "PoolExhaustedError",
    "Quantization",
    "Reuse",
    "Spec",
    "SpecError",
    "Strategy",
    "Tiering",
    "available_policies",
    "get_policy",
    "parse_spec",
    "parse_strategy",
    "register",
]
