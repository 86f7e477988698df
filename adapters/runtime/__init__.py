"""The eviction runtime both adapters share: attention routed through kvlib and the hand-off from a
cache's ``update`` to it (:mod:`.attention`, :mod:`.layer_step`), masks over stored slots, the
evictor that decides what a layer keeps (:mod:`.evictor`, built by :mod:`.make_evictor`,
its policies' inputs in :mod:`.needs`) and the routine that applies it to the store after a
layer's attention (:mod:`.after_attention`). Neither the drop-in cache nor the Engine is imported
here (an import contract in pyproject.toml)."""
