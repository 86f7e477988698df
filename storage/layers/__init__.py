"""One layer of the paged store (:class:`~kvlib.storage.layers.layer_pages.LayerPages`): its block table, its
writes, reads, compaction, truncation and sealing with the index arithmetic they share, and the dense
view a read returns (:class:`~kvlib.storage.layers.read_cache.LayerRead`)."""
