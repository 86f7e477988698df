"""The remote tier: page records on a Redis-protocol server (Redis or Valkey), shared by processes and hosts.

A :class:`RemoteTier` stores the same checked block records as the disk tier
(:mod:`~kvlib.storage.block_record`: header, namespace digest of model, dtype, codec and salt,
chain keys, token ids, checksum; never pickled) under server keys ``b"kvlib:p:" + namespace digest
+ chain key``, so several processes pointing at one server share prefixes and tenants stay apart
exactly as on disk. Writes and reads are pipelined: one round trip per batch of records.

Each value is an envelope around the record: ``b"KVLR"``, a version byte, a keyed byte, two zero
bytes, a 32-byte tag, then the record. With a key (``key=`` or the environment variable
``KVLIB_REMOTE_KEY``), the tag is BLAKE3 in keyed mode (the key: BLAKE3's ``derive_key`` of the
given secret under the context :data:`TAG_CONTEXT`) over the server key and the record, and only
records whose tag checks out are read: a writer without the key cannot plant KV that this process
decodes, nor move a record under another chain key. Without a key the tag is zeros and only
unkeyed records are read (a keyed record is not decoded by a process that lacks the key either).

Faults are misses, never errors:

- a server that is down, refuses, or answers no request within ``timeout_s`` (paused, overloaded)
  makes the call a miss (reads) or a dropped write, counted in ``errors``; the tier then skips the
  server for ``retry_s`` (calls in that window are counted in ``skipped``) and tries again after
  it, reconnecting to a restarted server by itself;
- a full server (``maxmemory`` with ``noeviction``) refuses writes: counted in ``write_errors``;
- a record that fails any check (envelope, tag, header, namespace, checksum, length) is a counted
  miss (``rejected`` for a tag, ``corrupt`` for the rest) and is left on the server: it may be
  another tenant's, and the block computed instead overwrites it when it is written.

Budget: the server's own ``maxmemory`` is the tier's byte budget. Run it with
``maxmemory-policy allkeys-lru`` (least recently used records are evicted; every read touches its
records) to keep it filling without refusals; with ``noeviction`` a full server refuses writes,
which the tier counts and goes on.

Hand-over queues (:meth:`RemoteTier.push` and :meth:`RemoteTier.pop`) carry small messages
between processes on the same server under ``b"kvlib:q:" + name``: see
:mod:`kvlib.adapters.handover` for what an Engine sends there.
"""

from __future__ import annotations

import importlib
import os
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

KEY_ENV = "KVLIB_REMOTE_KEY"
"""The environment variable holding the records' key when ``key=None``."""
TAG_CONTEXT = "kvlib remote tier 2026 record tag v1"
"""BLAKE3 ``derive_key`` context turning a secret into the 32-byte tag key."""
PREFIX = b"kvlib:p:"
QUEUE = b"kvlib:q:"
ENVELOPE = struct.Struct("<4sBB2x32s")
"""40 bytes before the record: magic, version, keyed flag, tag."""
MAGIC, VERSION = b"KVLR", 1
SCHEMES = ("redis://", "rediss://", "unix://")


def client_modules() -> tuple:
    """The ``redis`` client (with its ``retry`` and ``backoff`` modules loaded) and ``blake3``,
    imported when a remote tier is made: they are the optional extra ``kvlib[remote]``, so kvlib
    imports without them; ``ImportError`` naming the extra when one is missing."""
    try:
        modules = [importlib.import_module(name) for name in ("redis", "redis.retry", "redis.backoff", "blake3")]
    except ImportError as missing:
        raise ImportError(f"the remote tier needs the redis and blake3 packages: pip install 'kvlib[remote]' ({missing})") from missing
    return modules[0], modules[-1]


class RemoteTier:
    """Block records on the Redis-protocol server at ``url`` (``redis://host:port/db``,
    ``rediss://`` or ``unix://``); every fault a counted miss (see the module docstring).

    Args:
        url: the server.
        key: the secret tagging records (str or bytes); None reads ``$KVLIB_REMOTE_KEY``, and with
            that unset records are unkeyed.
        timeout_s: the longest one request (connect, or a pipelined batch) may take, seconds.
        retry_s: seconds the tier leaves a failed server alone before trying it again.
    """

    def __init__(self, url: str, *, key: str | bytes | None = None, timeout_s: float = 0.5, retry_s: float = 1.0) -> None:
        if not isinstance(url, str) or not url.startswith(SCHEMES):
            raise ValueError(f"remote must be a URL starting with one of {SCHEMES}, got {url!r}")
        for name, value in (("timeout_s", timeout_s), ("retry_s", retry_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if key is None:
            key = os.environ.get(KEY_ENV) or None
        if key is not None and (not isinstance(key, (str, bytes)) or not key):
            raise ValueError(f"key must be a non-empty str or bytes (or None for ${KEY_ENV}), got {type(key).__name__}")
        redis, blake3 = client_modules()
        self._hasher = blake3.blake3
        self._faults = (redis.RedisError, OSError)
        secret = key.encode() if isinstance(key, str) else key
        self.tag_key = None if secret is None else self._hasher(secret, derive_key_context=TAG_CONTEXT).digest()
        """32 bytes keying every record's tag, or None (unkeyed records)."""
        self.url = url
        self.timeout_s, self.retry_s = float(timeout_s), float(retry_s)
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            health_check_interval=0,
        )
        self.down_until = 0.0
        """``time.monotonic()`` before which the server is not contacted (after a failure)."""
        self.hits = self.misses = self.writes = 0
        self.corrupt = self.rejected = self.errors = self.write_errors = self.skipped = 0

    @property
    def keyed(self) -> bool:
        return self.tag_key is not None

    # -- records -------------------------------------------------------------------------------

    def seal(self, key: bytes, record: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """The value stored for ``record`` under server key ``key``, as chunks (envelope, record)."""
        record = memoryview(record).cast("B")
        tag = bytes(32) if self.tag_key is None else self._tag(key, record)
        return [ENVELOPE.pack(MAGIC, VERSION, self.keyed, tag), record]

    def open(self, key: bytes, value: bytes) -> memoryview | None:
        """The record inside ``value`` read under server key ``key``, or None (counted) when its
        envelope fails or its tag is not this tier's."""
        if len(value) < ENVELOPE.size:
            self.corrupt += 1
            return None
        magic, version, keyed, tag = ENVELOPE.unpack_from(value)
        if magic != MAGIC or version != VERSION:
            self.corrupt += 1
            return None
        record = memoryview(value)[ENVELOPE.size :]
        expected = bytes(32) if self.tag_key is None else self._tag(key, record)
        if keyed != self.keyed or tag != expected:
            self.rejected += 1
            return None
        return record

    def _tag(self, key: bytes, record: memoryview) -> bytes:
        hasher = self._hasher(key=self.tag_key)
        hasher.update(struct.pack("<Q", len(key)))
        hasher.update(key)
        hasher.update(record)
        return hasher.digest()

    def put_many(self, items: list[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        """Store every ``(key, record)`` (``key``: namespace digest + chain key) in one pipelined
        batch; returns how many the server took (0 when it is down, slow or full: counted)."""
        if not items or not self._available():
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key, record in items:
            name = PREFIX + key
            pipe.set(name, b"".join(self.seal(name, record)))
        results = self._execute(pipe)
        if results is None:
            return 0
        stored = sum(result is True for result in results)
        self.writes += stored
        self.write_errors += len(results) - stored
        return stored

    def get_many(self, keys: list[bytes], check: Callable[[memoryview], object]) -> list[object | None]:
        """``check(record)`` of the record under each of ``keys`` in one pipelined batch, None
        where it is absent, fails its envelope or tag, or ``check`` raises ``ValueError`` (all
        counted); every entry None when the server is down or slow (counted once)."""
        if not keys:
            return []
        values = None
        if self._available():
            pipe = self.client.pipeline(transaction=False)
            pipe.mget([PREFIX + key for key in keys])
            results = self._execute(pipe)
            values = results[0] if results is not None and isinstance(results[0], list) else None
        if values is None:
            self.misses += len(keys)
            return [None] * len(keys)
        out = []
        for key, value in zip(keys, values):
            record = None if value is None else self.open(PREFIX + key, value)
            result = None
            if record is not None:
                try:
                    result = check(record)
                except ValueError:
                    self.corrupt += 1
            self.hits += result is not None
            self.misses += result is None
            out.append(result)
        return out

    # -- hand-over queues ----------------------------------------------------------------------

    def push(self, queue: str, message: bytes) -> bool:
        """Append ``message`` to the list ``queue`` on the server; False (counted) when it cannot."""
        if not self._available():
            return False
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(QUEUE + queue.encode(), message)
        return self._execute(pipe) is not None

    def pop(self, queue: str, wait_s: float) -> bytes | None:
        """The oldest message of ``queue``, waiting up to ``wait_s`` seconds for one (below the
        request timeout: longer waits are several calls); None when none came or the server failed."""
        if not self._available():
            return None
        pipe = self.client.pipeline(transaction=False)
        if wait_s > 0:
            pipe.blpop([QUEUE + queue.encode()], timeout=max(0.01, min(wait_s, self.timeout_s / 2)))
        else:
            pipe.lpop(QUEUE + queue.encode())
        results = self._execute(pipe)
        if not results or results[0] is None:
            return None
        return results[0][1] if isinstance(results[0], (list, tuple)) else results[0]

    # -- faults --------------------------------------------------------------------------------

    def _available(self) -> bool:
        if time.monotonic() < self.down_until:
            self.skipped += 1
            return False
        return True

    def _execute(self, pipe: redis.client.Pipeline) -> list | None:
        """The pipeline's replies (errors among them as exceptions), or None after a fault that
        failed the whole batch: counted, and the server is left alone for ``retry_s``."""
        try:
            return pipe.execute(raise_on_error=False)
        except self._faults:
            self.errors += 1
            self.down_until = time.monotonic() + self.retry_s
            self.client.connection_pool.disconnect()
            return None
        finally:
            pipe.reset()

    def stats(self) -> dict[str, int]:
        """Blocks read and missed, records written, and the faults counted (see the module docstring)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "writes": self.writes,
            "corrupt": self.corrupt,
            "rejected": self.rejected,
            "errors": self.errors,
            "write_errors": self.write_errors,
            "skipped": self.skipped,
        }

    def close(self) -> None:
        self.client.close()
