"""The drop-in ``transformers`` cache: :func:`.make_cache.make_cache` builds a
:class:`.transformers_cache.KVCache` (one :class:`.cache_layer.KVCacheLayer` per layer) over the
paged store; :func:`.blend.blend_cache` assembles one from chunks."""
