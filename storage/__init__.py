"""Where KV bytes live, and the paged store that keeps them.

- the paged store (:class:`~kvlib.storage.paged_store.PagedStore`, ``kvlib.PagedStore``): per
  sequence and layer, each KV head's pages (block tables), the tokens' positions, writes, reads,
  compaction, truncation and sealing, step plans, read caches;
- pools: the arena of one layer's pages on one tier with its free list and reference counts
  (exact, coded, tiered over device, host and disk, partnered), made by :mod:`~kvlib.storage.pool_factory`;
- tiers and records: the disk tier on lmdb, the remote tier (a Redis-protocol server), spilled
  pages' and prefix blocks' checked records;
- reuse: the prefix store and index (hash-chained blocks) and held contexts.

Above the kernels (:mod:`kvlib.kernels`) and the strategy API; beside, and independent of,
:mod:`kvlib.strategies` (``pyproject.toml``'s import contracts).
"""

from kvlib.storage.page_pool import PagePool

__all__ = ["PagePool"]
