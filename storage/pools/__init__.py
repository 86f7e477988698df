"""Page pools: the arena of one layer's pages on one device with its free list and reference counts
(:class:`~kvlib.storage.pools.page_pool.PagePool`), the formats it holds its pages in
(:mod:`~kvlib.storage.pools.formats`), and a tiered pool's host and disk rows, staging arena,
placement and prefetch."""
