"""Adapters that put the paged store to work on a model: the drop-in transformers cache and the Engine.

- :func:`make_cache` builds a :class:`KVCache`, a drop-in ``transformers`` cache for
  ``model.generate``;
- :func:`attach` routes a model's attention through kvlib (``make_cache`` calls it);
- :func:`blend_cache` assembles a prompt's cache from chunks computed on their own (CacheBlend);
- :class:`Engine` serves many requests at once: continuous batching over the paged store;
- :func:`compressed_context` holds a KVzip-compressed context whole and forks it for each question.
"""

from kvlib.adapters.cache.blend import blend_cache
from kvlib.adapters.cache.kvzip_context import compressed_context
from kvlib.adapters.cache.make_cache import make_cache
from kvlib.adapters.cache.model_hooks import attach
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.adapters.engine.engine import Engine

__all__ = ["Engine", "KVCache", "attach", "blend_cache", "compressed_context", "make_cache"]
