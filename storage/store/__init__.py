"""The paged store (:class:`~kvlib.storage.store.paged_store.PagedStore`, ``kvlib.PagedStore``): its configuration,
the pools it builds, its state, sequences, reads and read caches, and the decode step planned once for
every layer."""
