"""Where KV bytes live, and the paged store that keeps them, in sub-packages that name their parts
(each imports only those after it in this list):

- :mod:`~kvlib.storage.prefix`: the prefix store and index (hash-chained blocks) and held contexts;
- :mod:`~kvlib.storage.store`: the paged store (``kvlib.PagedStore``): its configuration and pools,
  per sequence and layer each KV head's pages and the tokens' positions, reads and read caches,
  step plans;
- :mod:`~kvlib.storage.layers`: one layer of it: block tables, writes, reads, compaction,
  truncation and sealing;
- :mod:`~kvlib.storage.pools`: the arena of one layer's pages on one device with its free list and
  reference counts, the formats that hold its pages (float, coded, tiered, partnered), a tiered
  pool's host and disk rows, placement and prefetch;
- :mod:`~kvlib.storage.tiers`: the disk tier on lmdb, the remote tier (a Redis-protocol server);
- :mod:`~kvlib.storage.records`: spilled pages' and prefix blocks' checked records.

Above the kernels (:mod:`kvlib.kernels`) and the policy API; beside, and independent of,
:mod:`kvlib.policies` (``pyproject.toml``'s import contracts).
"""

from kvlib.storage.pools.page_pool import PagePool

__all__ = ["PagePool"]
