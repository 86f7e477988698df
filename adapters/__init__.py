"""Adapters that put the paged store to work: the transformers cache (and, as it lands, the scheduler).

- :func:`make_cache` builds a :class:`KVCache`, a drop-in ``transformers`` cache for
  ``model.generate``;
- :func:`attach` routes a model's attention through kvlib (``make_cache`` calls it);
- :func:`blend_cache` assembles a prompt's cache from chunks computed on their own (CacheBlend);
- :class:`Engine` serves many requests at once: continuous batching over the paged store.
"""

from kvlib.adapters.cache.blend import blend_cache
from kvlib.adapters.cache.make_cache import make_cache
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.adapters.engine.engine import Engine
from kvlib.adapters.runtime.attention import attach

__all__ = ["Engine", "KVCache", "attach", "blend_cache", "make_cache"]
