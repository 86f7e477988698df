"""The remote tier: page records on a Redis-protocol server (Redis or Valkey), shared by processes and hosts.

A :class:`RemoteTier` stores the same checked block records as the disk tier
(:mod:`~kvlib.storage.records.prefix_block_record`: header, namespace digest of model, dtype, codec and salt,
chain keys, token ids, checksum; never pickled), so several processes pointing at one server with
one key share prefixes. Writes and reads are pipelined: one round trip per batch of records.

Keys (:mod:`~kvlib.storage.tiers.tier_keys`): a shared server is a trust boundary, so a key is required:
``key=`` or the environment variable ``KVLIB_REMOTE_KEY``, bytes of at least 16 or a passphrase of
at least 20 characters (a weaker one is refused, naming what is valid). Without one the tier is
refused with a ``ValueError`` saying how to set one, unless the caller opts out by name with
``trust="any-writer"``: then records and messages are unkeyed, and anyone who can write to the
server can steer what this process decodes; that is for a private server only (one process, a
test, a loopback server no one else reaches). A keyed tier never reads unkeyed records and the
other way round. From the key come three keys of their own (one per job):

- names: a keyed tier's server names are keyed digests, ``b"kvlib:p:"`` + BLAKE3(name key,
  namespace digest + chain key) for records and ``b"kvlib:q:"`` / ``b"kvlib:t:"`` + a hex digest of
  the queue's name for hand-over queues and their taken ids. Tenants with different keys thus
  never touch each other's records or queues (no overwrites, no consumed messages), and a reader
  of the server learns nothing of the token ids behind a name. An unkeyed tier uses the plain
  names (``b"kvlib:p:" + namespace digest + chain key``, ``b"kvlib:q:" + queue``);
- tags and encryption: each value is an envelope, ``b"KVLR"``, version 2, a mode byte, two zero
  bytes, then by mode: 0 (unkeyed) the record; 1 (tagged: ``encrypt=False``) a 32-byte BLAKE3
  keyed tag over the server name and the record, then the record; 2 (sealed, the default for a
  keyed tier) a 12-byte random nonce and the record encrypted with AES-256-GCM (``cryptography``),
  the server name as associated data. Only values whose tag (or AEAD tag) checks out are read: a
  writer without the key can neither plant KV that this process decodes, nor move a value under
  another name, nor (mode 2) read the prompts and pages. A keyed tier reads modes 1 and 2.
  Encryption costs nothing here: AES-GCM ran at ~9,500 MB/s on a 394 KB record against ~6,200 (best of 5)
  for the BLAKE3 tag it replaces (AES-NI; ``docs/security.md``). Random nonces bound a key to
  about 2**32 writes; rotate it well before.

Faults are misses, never errors:

- a server that is down, refuses, or answers no request within ``timeout_s`` (paused, overloaded)
  makes the call a miss (reads) or a dropped write, counted in ``errors``; the tier then skips the
  server for ``retry_s`` (calls in that window are counted in ``skipped``) and tries again after
  it, reconnecting to a restarted server by itself;
- a full server (``maxmemory`` with ``noeviction``) refuses writes: counted in ``write_errors``;
- a record that fails any check (envelope, tag, header, namespace, checksum, length) is a counted
  miss (``rejected`` for a tag, ``corrupt`` for the rest) and is left on the server: the block
  computed instead overwrites it when it is written.

Access: a server that refuses the credentials (a wrong or missing password: ``NOAUTH``,
``WRONGPASS``) or the commands (an ACL: ``NOPERM``) is not an outage: the call raises
:class:`~kvlib.errors.RemoteAccessDenied`, naming the server with its password redacted, and
counts nothing. The tier asks the server once when it is made (a ``PING``), so a bad password
fails there, before any model work; a server down at that moment is an outage as above. No
message, ``repr`` or stat of a tier shows the password or the key (:func:`redacted`).

Hits: ``hits`` counts records that were used, not records that arrived. :meth:`RemoteTier.get_many`
counts the keys it found nothing valid under as ``misses``; the caller reports what it did with
the records it got back (:meth:`RemoteTier.count_use`: a record of another prefix's tokens, or one
past a gap in the chain, is counted in ``misses`` and ``unused``).

Budget: the server's own ``maxmemory`` is the tier's byte budget. Every record is written with a
time to live (``record_ttl_s``, a week by default; a read does not renew it) and hand-over queues
and taken-id sets without one, so run the server with ``maxmemory-policy volatile-lru``: the least
recently used records are evicted to make room, and a queued hand-over message or a taken id never
is (under ``allkeys-lru`` they are: :meth:`RemoteTier.eviction_policy` lets an Engine warn about
it). When nothing evictable is left, the server refuses writes: counted in ``write_errors``; a
refused hand-over is reported to the caller, never taken as sent.

Hand-over queues carry small messages between processes on the same server (see
:mod:`kvlib.adapters.engine.handover` for what an Engine sends): :meth:`RemoteTier.push` appends a
sealed message; a reader looks at the oldest ones without taking them (:meth:`RemoteTier.peek`),
checks each (:meth:`RemoteTier.open_message`) and only then takes it: :meth:`RemoteTier.take`
records its id in the queue's taken set (``ZADD NX``, scored by its send time) and removes it from
the queue in one transaction, and says whether the id was new. So a message is consumed only by a
reader holding its key, exactly once across every reader and restart of the readers (while the
server keeps the set), and one that fails its checks is removed (:meth:`RemoteTier.discard`;
in a queue named by the key only a forgery fails).
"""

from __future__ import annotations

import hmac
import importlib
import math
import os
import re
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlib.errors import RemoteAccessDenied, quoted
from kvlib.storage.tiers.tier_keys import subkey, tier_master_key

if TYPE_CHECKING:
    import redis

KEY_ENV = "KVLIB_REMOTE_KEY"
"""The environment variable holding the records' key when ``key=None``."""
TRUST_MODES = ("key", "any-writer")
"""``trust=``: ``"key"`` (a key is required, only records and messages tagged with it are read) or
``"any-writer"`` (no key: unkeyed records and messages, for a private server only)."""
RECORD_TTL_S = 7 * 24 * 3600
"""Seconds a record lives on the server by default (see the module docstring's budget)."""
PREFIX = b"kvlib:p:"
QUEUE = b"kvlib:q:"
TAKEN = b"kvlib:t:"
ENVELOPE = struct.Struct("<4sBB2x")
"""8 bytes before a value's body: magic, version, mode."""
MAGIC, VERSION = b"KVLR", 2
UNKEYED, TAGGED, SEALED = 0, 1, 2
"""Envelope modes (see the module docstring)."""
TAG_BYTES, NONCE_BYTES, AEAD_TAG_BYTES = 32, 12, 16
OVERHEAD = ENVELOPE.size + TAG_BYTES
"""Bytes a value holds at most beyond its record or message (a tag, or a nonce and an AEAD tag)."""
SCHEMES = ("redis://", "rediss://", "unix://")
PEEK = 16
"""Messages :meth:`RemoteTier.peek` reads at most per round trip."""


def client_modules(keyed: bool) -> tuple:
    """The ``redis`` client (with its ``retry`` and ``backoff`` modules loaded), ``blake3`` and, for
    a ``keyed`` tier, ``cryptography``'s AES-GCM class and its ``InvalidTag`` (else None), imported when a remote tier is
    made: they are the optional extra ``kvlib[remote]``, so kvlib imports without them;
    ``ImportError`` naming the extra when one is missing."""
    names = ["redis", "redis.retry", "redis.backoff", "blake3"] + (
        ["cryptography.hazmat.primitives.ciphers.aead", "cryptography.exceptions"] if keyed else []
    )
    try:
        modules = [importlib.import_module(name) for name in names]
    except ImportError as missing:
        raise ImportError(
            f"the remote tier needs the redis, blake3 and cryptography packages: pip install 'kvlib[remote]' ({missing})"
        ) from missing
    return modules[0], modules[3], (modules[4].AESGCM, modules[5].InvalidTag) if keyed else None


def redacted(url: str) -> str:
    """``url`` without its credentials: the user and password before ``@`` and any ``password=``
    in its query are replaced by ``***`` (for messages and reprs)."""
    head, at, tail = url.rpartition("@")
    if at:
        scheme = head.split("//", 1)[0] + "//" if "//" in head else ""
        url = f"{scheme}***@{tail}"
    return re.sub(r"(?i)(password|pass|pwd)=[^&#]*", r"\1=***", url)


def tier_secret(key: str | bytes | None, trust: str) -> bytes | None:
    """The 32-byte master key of a tier (:mod:`~kvlib.storage.tiers.tier_keys`): from ``key``, else
    ``$KVLIB_REMOTE_KEY``; None (unkeyed) only with ``trust="any-writer"``. ``ValueError`` saying
    how to set a key when there is none or it is too weak, and for a key given together with
    ``trust="any-writer"``."""
    if trust not in TRUST_MODES:
        raise ValueError(f"trust must be one of {TRUST_MODES}, got {quoted(trust)}")
    if trust == "any-writer":
        if key is not None:
            raise ValueError("trust='any-writer' is for a tier without a key; with key= the tier reads only records tagged with it")
        return None
    if key is not None:
        return tier_master_key(key, "remote_key")
    secret = os.environ.get(KEY_ENV) or None
    if secret is None:
        raise ValueError(
            "a remote tier authenticates what it reads from the server, and no key was given: pass key= (remote_key= to"
            f" PrefixStore and Engine) or set ${KEY_ENV} to a secret that every process writing to the server holds;"
            " on a private server no one else can write to, opt out by name with trust='any-writer'"
            " (remote_trust='any-writer'): then anyone who can write there can steer this process's outputs"
        )
    return tier_master_key(secret, f"${KEY_ENV}")


class RemoteTier:
    """Block records and hand-over queues on the Redis-protocol server at ``url``
    (``redis://host:port/db``, ``rediss://`` or ``unix://``); every fault a counted miss, a
    refused password or ACL :class:`~kvlib.errors.RemoteAccessDenied` (see the module docstring).

    Args:
        url: the server (its password, if any, is never shown: :attr:`url` is :func:`redacted`).
        key: the secret keying records and messages: bytes of at least 16 or a passphrase str of at
            least 20 characters; None reads ``$KVLIB_REMOTE_KEY``.
        trust: ``"key"`` (default: a key is required) or ``"any-writer"`` (no key, unkeyed records
            and messages that anyone who can write to the server can forge: a private server only).
        encrypt: a keyed tier encrypts what it writes (AES-256-GCM; default) or only tags it
            (False); it reads either. Ignored without a key.
        timeout_s: the longest one request (connect, or a pipelined batch) may take, seconds.
        retry_s: seconds the tier leaves a failed server alone before trying it again.
        record_ttl_s: seconds each record lives on the server (hand-over queues have no time to
            live, so ``volatile-lru`` evicts records and never a queue).

    Not thread-safe: one tier per thread (a store or Engine uses its tier from its own thread).
    """

    def __init__(
        self,
        url: str,
        *,
        key: str | bytes | None = None,
        trust: str = "key",
        encrypt: bool = True,
        timeout_s: float = 0.5,
        retry_s: float = 1.0,
        record_ttl_s: float = RECORD_TTL_S,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(SCHEMES):
            shown = quoted(redacted(url)) if isinstance(url, str) else type(url).__name__
            raise ValueError(f"remote must be a URL starting with one of {SCHEMES}, got {shown}")
        for name, value in (("timeout_s", timeout_s), ("retry_s", retry_s), ("record_ttl_s", record_ttl_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {quoted(value)}")
        if not isinstance(encrypt, bool):
            raise ValueError(f"encrypt must be True or False, got {quoted(encrypt)}")
        master = tier_secret(key, trust)
        redis, blake3, aead = client_modules(master is not None)
        self._hasher = blake3.blake3
        self._faults = (redis.RedisError, OSError)
        self._denials = (redis.AuthenticationError, redis.exceptions.NoPermissionError)
        self.tag_key = None if master is None else subkey(master, "remote record tag")
        """32 bytes keying every value's tag, or None (unkeyed: ``trust="any-writer"``)."""
        self._name_key = None if master is None else subkey(master, "remote server names")
        self._cipher = None if master is None else aead[0](subkey(master, "remote record encryption"))
        """AES-256-GCM under this tier's key (a keyed tier reads sealed values whatever ``encrypt``)."""
        self._invalid = None if master is None else aead[1]
        self._encrypt = encrypt and master is not None
        self.url = redacted(url)
        """The server's URL, credentials redacted."""
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
        pipe = self.client.pipeline(transaction=False)
        pipe.ping()
        self._execute(pipe)  # a refused password raises here; a server down is an outage like any other

    @property
    def keyed(self) -> bool:
        return self.tag_key is not None

    @property
    def encrypted(self) -> bool:
        """Whether this tier encrypts what it writes (a keyed tier with ``encrypt=True``)."""
        return self._encrypt

    def __repr__(self) -> str:
        mode = "encrypted" if self.encrypted else "tagged" if self.keyed else "unkeyed"
        return f"RemoteTier({self.url!r}, {mode})"

    # -- names and envelopes -------------------------------------------------------------------

    def record_name(self, key: bytes) -> bytes:
        """The server name of the record under ``key`` (namespace digest + chain key)."""
        return PREFIX + (key if self._name_key is None else self._hasher(key, key=self._name_key).digest())

    def queue_names(self, queue: str) -> tuple[bytes, bytes]:
        """The server names of hand-over queue ``queue`` and of its taken-id set."""
        name = (
            queue.encode()
            if self._name_key is None
            else self._hasher(b"queue\0" + queue.encode(), key=self._name_key).hexdigest()[:32].encode()
        )
        return QUEUE + name, TAKEN + name

    def seal(self, name: bytes, record: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """The value stored for ``record`` under server name ``name``, as chunks to join."""
        record = memoryview(record).cast("B")
        if self.encrypted:
            nonce = os.urandom(NONCE_BYTES)
            return [ENVELOPE.pack(MAGIC, VERSION, SEALED), nonce, self._cipher.encrypt(nonce, record, name)]
        if self.tag_key is not None:
            return [ENVELOPE.pack(MAGIC, VERSION, TAGGED), self._tag(name, record), record]
        return [ENVELOPE.pack(MAGIC, VERSION, UNKEYED), record]

    def open(self, name: bytes, value: bytes) -> memoryview | bytes | None:
        """The record inside ``value`` read under server name ``name``, or None (counted) when its
        envelope fails (``corrupt``) or its tag is not this tier's key's (``rejected``)."""
        if not isinstance(value, bytes) or len(value) < ENVELOPE.size:
            self.corrupt += 1
            return None
        magic, version, mode = ENVELOPE.unpack_from(value)
        if magic != MAGIC or version != VERSION or mode not in (UNKEYED, TAGGED, SEALED):
            self.corrupt += 1
            return None
        body = memoryview(value)[ENVELOPE.size :]
        if (mode == UNKEYED) == self.keyed:
            self.rejected += 1
            return None
        if mode == UNKEYED:
            return body
        if mode == TAGGED:
            record = body[TAG_BYTES:]
            if len(body) < TAG_BYTES or not hmac.compare_digest(bytes(body[:TAG_BYTES]), self._tag(name, record)):
                self.rejected += 1
                return None
            return record
        return self._decrypt(name, body)

    def _decrypt(self, name: bytes, body: memoryview) -> bytes | None:
        if len(body) < NONCE_BYTES + AEAD_TAG_BYTES:
            self.rejected += 1
            return None
        try:
            return self._cipher.decrypt(bytes(body[:NONCE_BYTES]), body[NONCE_BYTES:], name)
        except self._invalid:  # not sealed with this key, or altered
            self.rejected += 1
            return None

    def _tag(self, name: bytes, record: memoryview) -> bytes:
        hasher = self._hasher(key=self.tag_key)
        hasher.update(struct.pack("<Q", len(name)))
        hasher.update(name)
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
            name = self.record_name(key)
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
        names = [self.record_name(key) for key in keys]
        if self._available():
            pipe = self.client.pipeline(transaction=False)
            pipe.mget(names)
            results = self._execute(pipe)
            values = results[0] if results is not None and isinstance(results[0], list) else None
        if values is None:
            self.misses += len(keys)
            return [None] * len(keys)
        out = []
        for name, value in zip(names, values):
            record = None if value is None else self.open(name, value)
            result = None
            if record is not None:
                try:
                    result = check(memoryview(record))
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
        """Append ``message``, sealed (under the queue's server name), to hand-over queue ``queue``;
        False when the server did not take it (down, slow: ``errors``; full, out of memory:
        ``write_errors``)."""
        if not self._available():
            return False
        name, _ = self.queue_names(queue)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(name, b"".join(self.seal(name, message)))
        results = self._execute(pipe)
        if results is None:
            return False
        if isinstance(results[0], bool) or not isinstance(results[0], int):  # a refusal (OOM) comes back as an error
            self.write_errors += 1
            return False
        return True

    def peek(self, queue: str, wait_s: float) -> list[bytes]:
        """The oldest values (at most :data:`PEEK`) in hand-over queue ``queue``, as stored and left
        there (open each with :meth:`open_message`, then :meth:`take` or :meth:`discard` it),
        waiting up to ``wait_s`` seconds for one; empty when none came (a server that is down or
        slow meanwhile is counted and retried after ``retry_s`` within the wait). The wait polls,
        every 10 ms at first and at most every 50 ms."""
        name, _ = self.queue_names(queue)
        deadline = time.monotonic() + wait_s
        pause = 0.01
        while True:
            if self._available():
                pipe = self.client.pipeline(transaction=False)
                pipe.lrange(name, 0, PEEK - 1)
                results = self._execute(pipe)
                values = results[0] if results else None
                if isinstance(values, Exception):  # not a list (a key of another type planted there): counted, nothing to read
                    self.errors += 1
                    return []
                if values:
                    return [value for value in values if isinstance(value, bytes)]
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(left, max(pause, self.down_until - time.monotonic())))
            pause = min(2 * pause, 0.05)

    def open_message(self, queue: str, value: bytes, max_bytes: int) -> memoryview | bytes | None:
        """The message inside a value read from ``queue``, or None (counted) when it is longer than
        ``max_bytes`` (refused before its tag is computed: ``corrupt``), its envelope fails or its
        tag is not this tier's key's (a message this tier's key did not seal)."""
        if len(value) > OVERHEAD + max_bytes:
            self.corrupt += 1
            return None
        return self.open(self.queue_names(queue)[0], value)

    def take(self, queue: str, value: bytes, taken_id: str, sent_at: float, horizon: float) -> tuple[bool, bool] | None:
        """Take ``value`` (read by :meth:`peek`, checked) off ``queue``: in one transaction, its
        ``taken_id`` is added to the queue's taken set scored ``sent_at`` unless there already
        (``ZADD NX``), one copy of the value is removed from the queue, and ids scored below
        ``horizon`` (too old to be taken anyway) are dropped from the set. Returns ``(new,
        removed)``: ``new`` when the id was not taken before (this reader takes the message), else
        ``removed`` tells a replay or duplicate (a copy removed here) from a message another reader
        took first (nothing left to remove); None when the server did not answer (the value stays
        queued for a later call)."""
        if not self._available():
            return None
        name, taken = self.queue_names(queue)
        pipe = self.client.pipeline(transaction=True)
        pipe.zremrangebyscore(taken, "-inf", f"({horizon!r}")
        pipe.zadd(taken, {taken_id: sent_at}, nx=True)
        pipe.lrem(name, 1, value)
        results = self._execute(pipe)
        if results is None or any(isinstance(result, Exception) for result in results):
            return None
        return results[1] == 1, results[2] == 1

    def discard(self, queue: str, value: bytes) -> None:
        """Remove ``value`` (one that failed its checks) from ``queue``; a fault leaves it there."""
        if self._available():
            pipe = self.client.pipeline(transaction=False)
            pipe.lrem(self.queue_names(queue)[0], 1, value)
            self._execute(pipe)

    def eviction_policy(self) -> str | None:
        """The server's ``maxmemory-policy``, or None when it does not say (``CONFIG`` disabled,
        or the server down: not counted as a fault)."""
        try:
            reply = self.client.config_get("maxmemory-policy")
        except self._denials as error:
            raise self._denied(error) from None
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
        failed the whole batch: counted, and the server is left alone for ``retry_s``.
        :class:`~kvlib.errors.RemoteAccessDenied` when the server refuses the credentials or a
        command (not counted: not an outage)."""
        try:
            results = pipe.execute(raise_on_error=False)
        except self._denials as error:
            self.client.connection_pool.disconnect()
            raise self._denied(error) from None
        except self._faults:
            self.errors += 1
            self.down_until = time.monotonic() + self.retry_s
            self.client.connection_pool.disconnect()
            return None
        finally:
            pipe.reset()
        for result in results:
            if isinstance(result, self._denials) or (
                isinstance(result, Exception) and str(result).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))
            ):
                raise self._denied(result)
        return results

    def _denied(self, error: Exception) -> RemoteAccessDenied:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        return RemoteAccessDenied(
            f"the server at {self.url} refused kvlib's access ({type(error).__name__}: {reason[:120]}): check the password"
            " in the URL and that its user may run GET, SET, MGET, RPUSH, LRANGE, LREM, ZADD and ZREMRANGEBYSCORE on kvlib:* keys"
        )

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
