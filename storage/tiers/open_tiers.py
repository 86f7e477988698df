"""Opening the tiers a user's arguments name: a disk tier by directory (one lmdb environment per
directory and process), a remote tier by URL (with its key and trust).

:class:`~kvlib.storage.prefix.prefix_store.PrefixStore`, the caches that spill to disk and the Engine
take a tier object or its name; these functions turn a name into the tier, or refuse it with a
``ValueError`` that names what is valid, before any model work.
"""

from __future__ import annotations

import hmac
import warnings
import weakref
from pathlib import Path

from kvlib.errors import DiskTierUnavailable
from kvlib.storage.tiers.disk_tier import DiskTier, tag_key
from kvlib.storage.tiers.remote_tier import RemoteTier

_OPEN: weakref.WeakValueDictionary[Path, DiskTier] = weakref.WeakValueDictionary()
"""The tiers open in this process, by resolved directory (see :func:`open_disk_tier`)."""


def open_disk_tier(path: str | Path, capacity_bytes: int, key: str | bytes | None = None) -> DiskTier:
    """The :class:`DiskTier` at ``path`` already open in this process (its capacity raised to
    ``capacity_bytes`` if lower), or a new one holding up to ``capacity_bytes`` of prefix
    records, keyed by ``key`` (None: ``$KVLIB_DISK_KEY`` or unkeyed): lmdb allows one environment
    per file per process, so a prefix store and spilling caches given the same directory share
    one. :class:`~kvlib.errors.DiskTierUnavailable` if the directory cannot hold one;
    ``ValueError`` for a weak key, or one other than the open tier's."""
    wanted = tag_key(key)
    resolved = Path(path).resolve()
    tier = _OPEN.get(resolved)
    if tier is None or tier.closed or not tier.attached():  # a removed or replaced directory: a new environment
        tier = DiskTier(path, capacity_bytes, key=key)
        _OPEN[resolved] = tier
    elif (tier.tag_key is None) != (wanted is None) or (wanted is not None and not hmac.compare_digest(tier.tag_key, wanted)):
        raise ValueError(f"the disk tier at {path} is open in this process with another disk key (or none): use one key per directory")
    elif capacity_bytes > tier.capacity_bytes:
        tier.extend_limit(capacity_bytes - tier.capacity_bytes)
        tier.capacity_bytes = capacity_bytes
    return tier


def disk_tier(disk: DiskTier | str | Path | None, capacity_bytes: int, key: str | bytes | None = None) -> DiskTier | None:
    """The disk tier ``disk`` names: a :class:`~kvlib.storage.tiers.disk_tier.DiskTier` as given, the one
    :func:`open_disk_tier` gives for a directory (holding up to ``capacity_bytes``, keyed by
    ``key``; a directory that cannot hold one: a warning and None, prefixes stay in memory), or
    None. ``ValueError`` for anything else, and for a ``key`` given with a tier object (a
    ``DiskTier`` takes ``key=`` itself)."""
    if isinstance(disk, (str, bytes)) or hasattr(disk, "__fspath__"):
        try:
            return open_disk_tier(disk, capacity_bytes=capacity_bytes, key=key)
        except DiskTierUnavailable as error:
            warnings.warn(f"{error}; prefixes stay in memory", stacklevel=3)
            return None
    if key is not None:
        raise ValueError("disk_key is for a disk tier given by directory; a DiskTier takes key= itself")
    if disk is not None and not isinstance(disk, DiskTier):
        raise ValueError(f"disk must be a DiskTier, a path or None, got {type(disk).__name__}")
    return disk


def remote_tier(remote: RemoteTier | str | None, key: str | bytes | None, trust: str) -> RemoteTier | None:
    """The remote tier ``remote`` names: a :class:`~kvlib.storage.tiers.remote_tier.RemoteTier` as
    given, one made for a URL with ``key`` and ``trust`` (``ValueError`` without a key unless
    ``trust="any-writer"``), or None. ``key`` and ``trust`` go with a URL only."""
    if isinstance(remote, str):
        return RemoteTier(remote, key=key, trust=trust)
    if key is not None or trust != "key":
        raise ValueError("remote_key and remote_trust are for a remote tier given by URL; a RemoteTier takes key= and trust= itself")
    if remote is not None and not isinstance(remote, RemoteTier):
        raise ValueError(f"remote must be a RemoteTier, a redis:// URL or None, got {type(remote).__name__}")
    return remote
