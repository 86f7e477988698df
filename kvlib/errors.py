"""Errors raised by kvlib. Bad input is a ``ValueError`` (or a subclass) raised before any work."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec string or strategy object is invalid; the message lists what is valid."""


class PoolExhaustedError(RuntimeError):
    """A fixed-capacity page pool has fewer free pages than an operation needs.

    Raised before the operation changes anything, so nothing already stored is lost.
    """


class DiskTierUnavailable(RuntimeError):
    """A directory cannot hold a disk tier: it cannot be created or written, or its damaged
    files cannot be moved aside. The message names the directory and what failed."""
