"""Where KV bytes live: page arenas (and, with later tiers, host and disk pools)."""

from kvlib.storage.page_pool import PagePool

__all__ = ["PagePool"]
