"""The remote tier: page records on a Redis-protocol server (Redis or Valkey), shared by processes and hosts.

A :class:`RemoteTier` stores the same checked block records as the disk tier
(:mod:`~kvlib.storage.prefix_block_record`: header, namespace digest of model, dtype, codec and salt,
chain keys, token ids, checksum; never pickled) under server keys ``b"kvlib:p:" + namespace digest
+ chain key``, so several processes pointing at one server share prefixes and tenants stay apart
exactly as on disk. Writes and reads are pipelined: one round trip per batch of records.

Each value is an envelope around the record: ``b"KVLR"``, a version byte, a keyed byte, two zero
bytes, a 32-byte tag, then the record. The tag is BLAKE3 in keyed mode (the key: BLAKE3's
``derive_key`` of the given secret under the context :data:`TAG_CONTEXT`) over the server key and
the record, and only records whose tag checks out are read: a writer without the key cannot plant
KV that this process decodes, nor move a record under another chain key. Hand-over messages
(:meth:`RemoteTier.push`, :meth:`RemoteTier.open_message`) carry the same envelope, tagged over
their queue's name.

A shared server is a trust boundary, so a key is required: ``key=`` or the environment variable
``KVLIB_REMOTE_KEY`` (a secret every process that may write to the server holds). Without one the
tier is refused with a ``ValueError`` saying how to set one, unless the caller opts out by name
with ``trust="any-writer"``: then records and messages are unkeyed (tag zeros), and anyone who
can write to the server can steer what this process decodes; that is for a private server only
(one process, a test, a loopback server no one else reaches). A keyed tier never reads unkeyed
records and the other way round.

Faults are misses, never errors:

- a server that is down, refuses, or answers no request within ``timeout_s`` (paused, overloaded)
  makes the call a miss (reads) or a dropped write, counted in ``errors``; the tier then skips the
  server for ``retry_s`` (calls in that window are counted in ``skipped``) and tries again after
  it, reconnecting to a restarted server by itself;
- a full server (``maxmemory`` with ``noeviction``) refuses writes: counted in ``write_errors``;
- a record that fails any check (envelope, tag, header, namespace, checksum, length) is a counted
  miss (``rejected`` for a tag, ``corrupt`` for the rest) and is left on the server: it may be
  another tenant's, and the block computed instead overwrites it when it is written.

Hits: ``hits`` counts records that were used, not records that arrived. :meth:`RemoteTier.get_many`
counts the keys it found nothing valid under as ``misses``; the caller reports what it did with
the records it got back (:meth:`RemoteTier.count_use`: a record of another prefix's tokens, or one
past a gap in the chain, is counted in ``misses`` and ``unused``).

Budget: the server's own ``maxmemory`` is the tier's byte budget. Every record is written with a
time to live (``record_ttl_s``, a week by default; a read does not renew it) and hand-over queues
without one, so run the server with ``maxmemory-policy volatile-lru``: the least recently used
records are evicted to make room, and a queued hand-over message never is (under
``allkeys-lru`` the queue itself is evicted: :meth:`RemoteTier.eviction_policy` lets an Engine
warn about it). When nothing evictable is left (queued messages fill the budget, or
``noeviction``), the server refuses writes: counted in ``write_errors``; a refused hand-over is
reported to the caller, never taken as sent.

Hand-over queues (:meth:`RemoteTier.push` and :meth:`RemoteTier.pop`) carry small messages
between processes on the same server under ``b"kvlib:q:" + name``: see
:mod:`kvlib.adapters.engine.handover` for what an Engine sends there.
"""

from __future__ import annotations

import importlib
import math
import os
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlib.errors import quoted

if TYPE_CHECKING:
    import redis

KEY_ENV = "KVLIB_REMOTE_KEY"
"""The environment variable holding the records' key when ``key=None``."""
TAG_CONTEXT = "kvlib remote tier 2026 record tag v1"
"""BLAKE3 ``derive_key`` context turning a secret into the 32-byte tag key."""
TRUST_MODES = ("key", "any-writer")
"""``trust=``: ``"key"`` (a key is required, only records and messages tagged with it are read) or
``"any-writer"`` (no key: unkeyed records and messages, for a private server only)."""
RECORD_TTL_S = 7 * 24 * 3600
"""Seconds a record lives on the server by default (see the module docstring's budget)."""
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


def tier_secret(key: str | bytes | None, trust: str) -> bytes | None:
    """The secret tagging a tier's records: ``key``, else ``$KVLIB_REMOTE_KEY``; None (unkeyed)
    only with ``trust="any-writer"``. ``ValueError`` saying how to set a key when there is none,
    and for a key given together with ``trust="any-writer"``."""
    if trust not in TRUST_MODES:
        raise ValueError(f"trust must be one of {TRUST_MODES}, got {quoted(trust)}")
    if key is not None and (not isinstance(key, (str, bytes)) or not key):
        raise ValueError(f"key must be a non-empty str or bytes (or None for ${KEY_ENV}), got {type(key).__name__}")
    if trust == "any-writer":
        if key is not None:
            raise ValueError("trust='any-writer' is for a tier without a key; with key= the tier reads only records tagged with it")
        return None
    secret = key if key is not None else os.environ.get(KEY_ENV) or None
    if secret is None:
        raise ValueError(
            "a remote tier authenticates what it reads from the server, and no key was given: pass key= (remote_key= to"
            f" PrefixStore and Engine) or set ${KEY_ENV} to a secret that every process writing to the server holds;"
            " on a private server no one else can write to, opt out by name with trust='any-writer'"
            " (remote_trust='any-writer'): then anyone who can write there can steer this process's outputs"
        )
    return secret.encode() if isinstance(secret, str) else secret


class RemoteTier:
    """Block records on the Redis-protocol server at ``url`` (``redis://host:port/db``,
    ``rediss://`` or ``unix://``); every fault a counted miss (see the module docstring).

    Args:
        url: the server.
        key: the secret tagging records and messages (str or bytes); None reads ``$KVLIB_REMOTE_KEY``.
        trust: ``"key"`` (default: a key is required) or ``"any-writer"`` (no key, unkeyed records
            and messages that anyone who can write to the server can forge: a private server only).
        timeout_s: the longest one request (connect, or a pipelined batch) may take, seconds.
        retry_s: seconds the tier leaves a failed server alone before trying it again.
        record_ttl_s: seconds each record lives on the server (hand-over queues have no time to
            live, so ``volatile-lru`` evicts records and never a queue).
    """

    def __init__(
        self,
        url: str,
        *,
        key: str | bytes | None = None,
        trust: str = "key",
        timeout_s: float = 0.5,
        retry_s: float = 1.0,
        record_ttl_s: float = RECORD_TTL_S,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(SCHEMES):
            raise ValueError(f"remote must be a URL starting with one of {SCHEMES}, got {quoted(url)}")
        for name, value in (("timeout_s", timeout_s), ("retry_s", retry_s), ("record_ttl_s", record_ttl_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {quoted(value)}")
        secret = tier_secret(key, trust)
        redis, blake3 = client_modules()
        self._hasher = blake3.blake3
        self._faults = (redis.RedisError, OSError)
        self.tag_key = None if secret is None else self._hasher(secret, derive_key_context=TAG_CONTEXT).digest()
        """32 bytes keying every record's tag, or None (unkeyed records: ``trust="any-writer"``)."""
        self.url = url
        self.timeout_s, self.retry_s = float(timeout_s), float(retry_s)
        self.record_ttl_ms = max(1, round(record_ttl_s * 1000))
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            health_check_interval=0,
        )
        self.down_until = 0.0
        """``time.monotonic()`` before which the server is not contacted (after a failure)."""
        self.hits = self.misses = self.unused = self.writes = 0
        self.corrupt = self.rejected = self.errors = self.write_errors = self.skipped = 0

    @property
    def keyed(self) -> bool:
        return self.tag_key is not None

    # -- envelopes -----------------------------------------------------------------------------

    def seal(self, key: bytes, record: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """The value stored for ``record`` under server key ``key``, as chunks (envelope, record)."""
        record = memoryview(record).cast("B")
        tag = bytes(32) if self.tag_key is None else self._tag(key, record)
        return [ENVELOPE.pack(MAGIC, VERSION, self.keyed, tag), record]

    def open(self, key: bytes, value: bytes) -> memoryview | None:
        """The record inside ``value`` read under server key ``key``, or None (counted) when its
        envelope fails or its tag is not this tier's."""
        if not isinstance(value, bytes) or len(value) < ENVELOPE.size:
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

    # -- records -------------------------------------------------------------------------------

    def put_many(self, items: list[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        """Store every ``(key, record)`` (``key``: namespace digest + chain key) in one pipelined
        batch, each for ``record_ttl_s``; returns how many the server took (0 when it is down,
        slow or full: counted)."""
        if not items or not self._available():
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key, record in items:
            name = PREFIX + key
            pipe.set(name, b"".join(self.seal(name, record)), px=self.record_ttl_ms)
        results = self._execute(pipe)
        if results is None:
            return 0
        stored = sum(result is True for result in results)
        self.writes += stored
        self.write_errors += len(results) - stored
        return stored

    def get_many(self, keys: list[bytes], check: Callable[[memoryview], object]) -> list[object | None]:
        """``check(record)`` of the record under each of ``keys`` in one pipelined batch, None
        where it is absent, fails its envelope or tag, or ``check`` raises ``ValueError`` (each
        counted as a miss; every entry None when the server is down or slow, counted once). The
        records returned are not counted yet: the caller reports which it used with
        :meth:`count_use`."""
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
            self.misses += result is None
            out.append(result)
        return out

    def count_use(self, fetched: int, used: int) -> None:
        """Count ``fetched`` records that :meth:`get_many` returned: ``used`` of them were used
        (``hits``), the rest were not (``misses`` and ``unused``: another prefix's tokens, or past
        a gap in the chain)."""
        self.hits += used
        self.misses += fetched - used
        self.unused += fetched - used

    # -- hand-over queues ----------------------------------------------------------------------

    def push(self, queue: str, message: bytes) -> bool:
        """Append ``message``, sealed (tagged over the queue's name), to the list ``queue`` on the
        server; False when the server did not take it (down, slow: ``errors``; full, out of memory:
        ``write_errors``)."""
        if not self._available():
            return False
        name = QUEUE + queue.encode()
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(name, b"".join(self.seal(name, message)))
        results = self._execute(pipe)
        if results is None:
            return False
        if isinstance(results[0], bool) or not isinstance(results[0], int):  # a refusal (OOM) comes back as an error
            self.write_errors += 1
            return False
        return True

    def pop(self, queue: str, wait_s: float) -> bytes | None:
        """The oldest value in the list ``queue``, as stored (open it with :meth:`open_message`),
        waiting up to ``wait_s`` seconds for one; None when none came within ``wait_s`` (a server
        that is down or slow meanwhile is counted and retried after ``retry_s`` within the wait).
        A wait spans several blocking requests, each under the request timeout."""
        name = QUEUE + queue.encode()
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if self._available():
                pipe = self.client.pipeline(transaction=False)
                if left >= 0.01:  # BLPOP's shortest wait
                    pipe.blpop([name], timeout=min(left, self.timeout_s / 2))
                else:
                    pipe.lpop(name)
                results = self._execute(pipe)
                value = results[0] if results else None
                if isinstance(value, Exception):  # not a list (a key of another type planted there): counted, nothing to pop
                    self.errors += 1
                    return None
                if isinstance(value, (list, tuple)):
                    value = value[1]
                if isinstance(value, bytes):
                    return value
            else:
                time.sleep(max(0.0, min(left, self.down_until - time.monotonic())))
            if time.monotonic() >= deadline:
                return None

    def open_message(self, queue: str, value: bytes, max_bytes: int) -> memoryview | None:
        """The message inside a value popped from ``queue``, or None (counted) when it is longer
        than ``max_bytes`` (refused before its tag is computed: ``corrupt``), its envelope fails
        or its tag is not this tier's (a message this tier's key did not seal)."""
        if len(value) > ENVELOPE.size + max_bytes:
            self.corrupt += 1
            return None
        return self.open(QUEUE + queue.encode(), value)

    def eviction_policy(self) -> str | None:
        """The server's ``maxmemory-policy``, or None when it does not say (``CONFIG`` disabled,
        or the server down: not counted as a fault)."""
        try:
            reply = self.client.config_get("maxmemory-policy")
        except self._faults:
            return None
        value = reply.get(b"maxmemory-policy", reply.get("maxmemory-policy")) if isinstance(reply, dict) else None
        return value.decode() if isinstance(value, bytes) else value

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
        """Blocks used and missed, records written, and the faults counted (see the module docstring)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "unused": self.unused,
            "writes": self.writes,
            "corrupt": self.corrupt,
            "rejected": self.rejected,
            "errors": self.errors,
            "write_errors": self.write_errors,
            "skipped": self.skipped,
        }

    def close(self) -> None:
        self.client.close()
