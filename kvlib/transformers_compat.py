"""What differs between the `transformers` releases kvlib supports (``pyproject.toml``'s range).

transformers 5.24 renamed the cache argument of ``generate`` and of every model's ``forward``
from ``past_key_values`` to ``cache`` (the old name warns until 5.40 for forwards and 6.0 for
``generate``), renamed the outputs' field likewise, and started passing the attention keyword
arguments to ``Cache.update(..., kwargs=...)``. kvlib calls models through the names here, so
that no kvlib call raises a deprecation warning on any supported release.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version
from transformers.cache_utils import get_layer_types_and_kwargs

INSTALLED = Version(transformers.__version__)
"""The installed transformers release."""

CACHE_ARGUMENT = "cache" if INSTALLED >= Version("5.24.0.dev0") else "past_key_values"
"""The keyword under which ``generate`` and model forwards take a cache, and outputs return it."""

_ALL_CACHE_ARGUMENTS = ("cache", "past_key_values")

try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # releases before DummyLayer: none of their models has a layer that holds nothing

    class DummyLayer:
        """A cache layer that holds nothing (transformers' own, on releases that lack it): a layer
        of no attention, or one that reads another layer's cache."""

        is_compileable = True
        is_croppable = True

        def __init__(self, **kwargs: Any) -> None:
            self.is_initialized = True
            self.keys = None
            self.values = None

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[None, None]:
            if key_states is None and value_states is None:
                return None, None
            raise NotImplementedError("a layer that holds nothing cannot be updated")


def cache_argument(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``generate`` or a model call: ``model.generate(ids, **cache_argument(c))``."""
    return {CACHE_ARGUMENT: cache}


def passed_cache(kwargs: dict[str, Any]) -> Any:
    """The cache in a module call's keyword arguments under either name (a caller on 5.24+ may
    still pass the deprecated ``past_key_values``), or None."""
    for name in _ALL_CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_layer_types(text_config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """Per layer of a decoder's (text) config, the cache layer type ``DynamicCache(config=...)``
    builds (``"full_attention"``, ``"sliding_attention"``, ``"linear_attention"``, ``"hybrid"``,
    ``"dummy"``...) and its keyword arguments (``sliding_window``, ``number_of_states``), one
    entry per layer. transformers 5.18 returns one dict of keyword arguments for every layer and
    leaves KV-sharing layers out of the list (they hold no cache: ``"dummy"`` here, as 5.24 has it)."""
    types, kwargs = get_layer_types_and_kwargs(text_config)
    types = list(types)
    layers = getattr(text_config, "num_hidden_layers", len(types))
    if isinstance(layers, int) and len(types) < layers:
        types += ["dummy"] * (layers - len(types))
    if isinstance(kwargs, dict):
        kwargs = [dict(kwargs) if kind != "dummy" else {} for kind in types]
    return types, list(kwargs)


def layer_config(text_config: Any, layer: int) -> Any:
    """The config of one decoder layer: ``per_layer_config[layer]`` where the config has per-layer
    attributes (transformers' heterogeneous configs, whose global value of such an attribute is
    an error to read), else the config itself."""
    per_layer = getattr(type(text_config), "per_layer_config", None)
    return text_config.per_layer_config[layer] if per_layer is not None else text_config
