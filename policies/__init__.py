"""Every built-in strategy, one per file, grouped by kind. Importing this registers them."""

from kvlib.policies import eviction

__all__ = ["eviction"]
