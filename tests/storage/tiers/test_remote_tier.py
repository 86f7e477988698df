"""The remote tier against a real server (Valkey from ``kvlib[remote]``): records round-trip in
pipelined batches; a key is required unless the caller opts out by name; keyed records and
messages are read only with their key; a server killed, paused, restarted or full makes counted
misses, and the tier comes back with the server; records live under a time to live and queues
without one, so ``volatile-lru`` evicts records and never a queued message; ``pop`` waits what it
is told to."""

from __future__ import annotations

import time

import pytest
import redis

from kvlib.errors import RemoteAccessDenied
from kvlib.storage.tiers.local_server import LocalServer
from kvlib.storage.tiers.remote_tier import PREFIX, RECORD_TTL_S, RemoteTier, redacted

KEY = "kvlib-test-key-0123456789abcdef"
OTHER = "another-tenant-key-0123456789"


def check(record: memoryview) -> bytes:
    """A record check: records here must start with b"ok"."""
    if bytes(record[:2]) != b"ok":
        raise ValueError("not ok")
    return bytes(record)


def test_records_round_trip_in_one_batch_and_count_hits_only_when_used(redis_server) -> None:
    tier = RemoteTier(redis_server.url, key=KEY)
    assert tier.put_many([(b"a" * 32, b"ok-first"), (b"b" * 32, memoryview(b"ok-second"))]) == 2
    assert tier.get_many([b"a" * 32, b"c" * 32, b"b" * 32], check) == [b"ok-first", None, b"ok-second"]
    assert tier.get_many([b"a" * 32], lambda record: check(b"no")) == [None]  # a failing check is a miss
    assert tier.hits == 0 and tier.misses == 2  # the two records that arrived are not counted yet
    tier.count_use(fetched=2, used=1)  # the caller used one of them
    assert tier.stats() == {
        "hits": 1,
        "misses": 3,
        "unused": 1,
        "writes": 2,
        "corrupt": 1,
        "rejected": 0,
        "errors": 0,
        "write_errors": 0,
        "skipped": 0,
    }


def test_a_tier_without_a_key_is_refused_unless_the_caller_opts_out_by_name(redis_server, monkeypatch) -> None:
    monkeypatch.delenv("KVLIB_REMOTE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"no key was given: pass key= .*KVLIB_REMOTE_KEY.*trust='any-writer'"):
        RemoteTier(redis_server.url)
    assert not RemoteTier(redis_server.url, trust="any-writer").keyed
    with pytest.raises(ValueError, match="trust='any-writer' is for a tier without a key"):
        RemoteTier(redis_server.url, key=KEY, trust="any-writer")
    with pytest.raises(ValueError, match="trust must be one of"):
        RemoteTier(redis_server.url, trust="anyone")
    monkeypatch.setenv("KVLIB_REMOTE_KEY", KEY)
    assert RemoteTier(redis_server.url).keyed


def test_keyed_records_are_read_only_with_their_key(redis_server) -> None:
    owner = RemoteTier(redis_server.url, key=KEY)
    owner.put_many([(b"k" * 32, b"ok-owned")])
    assert owner.get_many([b"k" * 32], check) == [b"ok-owned"]
    for stranger in (RemoteTier(redis_server.url, key=OTHER), RemoteTier(redis_server.url, trust="any-writer")):
        assert stranger.get_many([b"k" * 32], check) == [None]  # other names: nothing there for them
    client = redis.Redis.from_url(redis_server.url)
    name = owner.record_name(b"k" * 32)
    assert name != PREFIX + b"k" * 32 and client.get(name)[8:].find(b"ok-owned") == -1  # a keyed name, an encrypted value
    for planter in (RemoteTier(redis_server.url, key=OTHER), RemoteTier(redis_server.url, key=OTHER, encrypt=False)):
        client.set(name, b"".join(planter.seal(name, b"ok-planted")))  # planted under the owner's name
        assert owner.get_many([b"k" * 32], check) == [None]
    unkeyed = RemoteTier(redis_server.url, trust="any-writer")
    client.set(name, b"".join(unkeyed.seal(name, b"ok-unkeyed")))
    assert owner.get_many([b"k" * 32], check) == [None] and owner.rejected == 3
    for encrypt in (True, False):
        writer = RemoteTier(redis_server.url, key=KEY, encrypt=encrypt)
        writer.put_many([(b"k" * 32, b"ok-owned")])
        assert owner.get_many([b"k" * 32], check) == [b"ok-owned"]  # a keyed tier reads sealed and tagged values
        client.copy(name, owner.record_name(b"m" * 32), replace=True)  # a valid value moved under another name
        value = bytearray(client.get(name))
        value[-1] ^= 1  # altered on the server
        client.set(name, bytes(value))
        assert owner.get_many([b"m" * 32, b"k" * 32], check) == [None, None]
    assert owner.rejected == 7


def test_a_killed_server_is_a_counted_miss_until_it_returns(redis_server) -> None:
    tier = RemoteTier(redis_server.url, key=KEY, timeout_s=0.5, retry_s=0.2)
    tier.put_many([(b"a" * 32, b"ok")])
    redis_server.kill()
    assert tier.get_many([b"a" * 32], check) == [None] and tier.errors == 1
    assert tier.put_many([(b"a" * 32, b"ok")]) == 0 and tier.skipped == 1  # left alone for retry_s
    redis_server.start()  # empty again (no persistence)
    time.sleep(0.25)
    assert tier.put_many([(b"a" * 32, b"ok-again")]) == 1
    assert tier.get_many([b"a" * 32], check) == [b"ok-again"]


def test_a_paused_server_times_out_and_the_tier_comes_back(redis_server) -> None:
    tier = RemoteTier(redis_server.url, key=KEY, timeout_s=0.2, retry_s=0.2)
    tier.put_many([(b"a" * 32, b"ok")])
    redis_server.pause()
    try:
        started = time.monotonic()
        assert tier.get_many([b"a" * 32], check) == [None]
        assert time.monotonic() - started < 2.0 and tier.errors == 1
        assert tier.put_many([(b"b" * 32, b"ok")]) == 0
    finally:
        redis_server.resume()
    time.sleep(0.25)
    assert tier.get_many([b"a" * 32], check) == [b"ok"]


def test_a_full_server_refuses_records_and_messages_as_counted_write_errors() -> None:
    with LocalServer(maxmemory=2 << 20, policy="noeviction") as server:
        tier = RemoteTier(server.url, key=KEY)
        stored = sum(tier.put_many([(bytes([i]) * 32, b"ok" + bytes(256 << 10))]) for i in range(32))
        assert 0 < stored < 32 and tier.write_errors == 32 - stored and tier.errors == 0
        assert tier.get_many([bytes([0]) * 32], check)[0] is not None
        assert not tier.push("jobs", bytes(256 << 10)) and tier.write_errors == 32 - stored + 1  # refused (OOM), said so
        assert tier.peek("jobs", 0.0) == []


def test_records_are_evicted_under_volatile_lru_and_queued_messages_never() -> None:
    with LocalServer(maxmemory=4 << 20, policy="volatile-lru") as server:
        tier = RemoteTier(server.url, key=KEY)
        assert tier.eviction_policy() == "volatile-lru"
        assert all(tier.push("jobs", b"job %d" % i) for i in range(3))
        client = redis.Redis.from_url(server.url)
        assert client.pttl(tier.queue_names("jobs")[0]) == -1  # no time to live: never evictable under volatile-*
        for i in range(64):  # 16 MiB of records through a 4 MiB budget
            assert tier.put_many([(i.to_bytes(32, "big"), b"ok" + bytes(256 << 10))]) == 1
        assert 0 < client.pttl(tier.record_name((63).to_bytes(32, "big"))) <= RECORD_TTL_S * 1000
        assert client.dbsize() < 64 and tier.write_errors == 0  # old records evicted to make room
        assert [bytes(tier.open_message("jobs", value, 1 << 20)) for value in tier.peek("jobs", 0.0)] == [b"job 0", b"job 1", b"job 2"]
    with LocalServer(policy="allkeys-lru") as server:
        assert RemoteTier(server.url, key=KEY).eviction_policy() == "allkeys-lru"


def next_message(tier: RemoteTier, queue: str, wait_s: float = 0.0) -> bytes | None:
    """The oldest message of ``queue`` opened by ``tier`` (None: none, or it failed), removed."""
    values = tier.peek(queue, wait_s)
    if not values:
        return None
    tier.discard(queue, values[0])
    message = tier.open_message(queue, values[0], 1 << 20)
    return None if message is None else bytes(message)


def test_queues_carry_sealed_messages_between_tiers_and_peek_waits_what_it_is_told(redis_server) -> None:
    sender, receiver = RemoteTier(redis_server.url, key=KEY), RemoteTier(redis_server.url, key=KEY)
    for wait_s in (0.0, 0.6):
        started = time.monotonic()
        assert receiver.peek("jobs", wait_s=wait_s) == []
        assert wait_s <= time.monotonic() - started < wait_s + 1.0
    assert sender.push("jobs", b"one") and sender.push("jobs", b"two")
    assert [next_message(receiver, "jobs", 0.1) for _ in range(2)] == [b"one", b"two"]
    client = redis.Redis.from_url(redis_server.url)
    name = receiver.queue_names("jobs")[0]
    for writer in (RemoteTier(redis_server.url, key=OTHER), RemoteTier(redis_server.url, trust="any-writer")):
        writer.push("jobs", b"elsewhere")  # another key's queue has another name: nothing arrives here
        client.rpush(name, b"".join(writer.seal(name, b"forged")))  # written straight into this key's queue
    client.rpush(name, b"raw")
    assert [next_message(receiver, "jobs") for _ in range(3)] == [None, None, None] and receiver.peek("jobs", 0.0) == []
    assert receiver.rejected == 2 and receiver.corrupt == 1
    sender.push("other-queue", b"moved")  # a sealed message moved to another queue fails its tag there
    client.rpush(name, client.lpop(receiver.queue_names("other-queue")[0]))
    assert next_message(receiver, "jobs") is None and receiver.rejected == 3
    sender.push("jobs", bytes(2 << 20))  # sealed, but longer than the reader takes: refused before its tag is computed
    assert next_message(receiver, "jobs") is None and receiver.corrupt == 2


def test_a_message_is_taken_once_across_readers(redis_server) -> None:
    sender, first, second = (RemoteTier(redis_server.url, key=KEY) for _ in range(3))
    sender.push("jobs", b"job")
    value = first.peek("jobs", 0.0)[0]
    assert second.peek("jobs", 0.0) == [value]  # peeking takes nothing
    now = time.time()
    assert first.take("jobs", value, "sender:1", now, now - 60) == (True, True)
    assert second.take("jobs", value, "sender:1", now, now - 60) == (False, False)  # taken first by the other reader
    redis.Redis.from_url(redis_server.url).rpush(sender.queue_names("jobs")[0], value)  # replayed
    assert second.take("jobs", value, "sender:1", now, now - 60) == (False, True) and second.peek("jobs", 0.0) == []
    assert first.take("jobs", value, "sender:2", now - 120, now - 60) == (True, False)
    assert first.take("jobs", value, "sender:3", now + 2, now + 1) == (True, False)
    members = redis.Redis.from_url(redis_server.url).zrange(sender.queue_names("jobs")[1], 0, -1)
    assert members == [b"sender:3"]  # ids scored below the horizon are dropped


def test_a_key_of_another_type_planted_on_a_queue_is_a_counted_error(redis_server) -> None:
    tier = RemoteTier(redis_server.url, key=KEY)
    redis.Redis.from_url(redis_server.url).set(tier.queue_names("jobs")[0], b"not a list")
    started = time.monotonic()
    assert (
        tier.peek("jobs", wait_s=5.0) == [] and tier.errors == 1 and time.monotonic() - started < 2.5
    )  # not a busy loop for the whole wait


@pytest.mark.parametrize(
    "kwargs",
    [
        {"url": "http://x", "key": "k"},
        {"url": "redis://x", "key": "k", "timeout_s": 0},
        {"url": "redis://x", "key": "k", "retry_s": -1},
        {"url": "redis://x", "key": "k", "record_ttl_s": float("inf")},
        {"url": "redis://x", "key": ""},
        {"url": "redis://x", "key": 5},
    ],
)
def test_bad_arguments_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RemoteTier(**kwargs)


def test_kvlib_imports_without_the_remote_and_ray_extras_and_names_the_extra_when_needed() -> None:
    """``redis``, ``blake3`` and ``ray`` are optional extras: kvlib imports without them, and a
    remote tier made without them says which extra to install (a child process where importing
    them fails)."""
    import subprocess
    import sys

    script = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("redis", "blake3", "ray"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
import kvlib, kvlib.eval.ray_compare
from kvlib.storage.tiers.remote_tier import RemoteTier
try:
    RemoteTier("redis://127.0.0.1:1", key="a-key-of-twenty-characters")
except ImportError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "pip install 'kvlib[remote]'" in done.stdout


def test_a_refused_password_or_acl_raises_with_the_password_redacted(redis_server) -> None:
    """A wrong or missing password, or an ACL that refuses kvlib's commands, is not an outage: it
    raises RemoteAccessDenied (when the tier is made, for a password), naming the server without its
    password, and counts nothing."""
    client = redis.Redis.from_url(redis_server.url)
    client.execute_command("ACL", "SETUSER", "reader", "on", ">reader-password-1234", "~elsewhere:*", "+@all")
    client.config_set("requirepass", "the-right-password-1234")
    host = redis_server.url.split("//", 1)[1]
    for url in (redis_server.url, f"redis://:a-wrong-password-5678@{host}"):
        with pytest.raises(RemoteAccessDenied, match="refused kvlib's access") as refused:
            RemoteTier(url, key=KEY)
        assert "wrong-password" not in str(refused.value) and "right-password" not in str(refused.value)
    limited = RemoteTier(f"redis://reader:reader-password-1234@{host}", key=KEY)  # PING passes; kvlib:* keys are refused
    for call in (
        lambda: limited.put_many([(b"k" * 32, b"ok")]),
        lambda: limited.get_many([b"k" * 32], check),
        lambda: limited.push("q", b"m"),
    ):
        with pytest.raises(RemoteAccessDenied, match=r"\*\*\*@.*NoPermissionError") as refused:
            call()
        assert "reader-password" not in str(refused.value)
    assert limited.stats()["errors"] == 0 and limited.down_until == 0.0  # not taken for an outage
    allowed = RemoteTier(f"redis://:the-right-password-1234@{host}", key=KEY)
    assert allowed.put_many([(b"k" * 32, b"ok")]) == 1 and "the-right-password" not in repr(allowed) + allowed.url + str(allowed.stats())


@pytest.mark.parametrize(
    "url",
    ["redsi://:hunter2-secret@host:6379/0", "redis:/user:hunter2-secret@host", "http://host/?password=hunter2-secret", "hunter2-secret"],
)
def test_a_mistyped_url_never_echoes_its_password(url: str) -> None:
    with pytest.raises(ValueError, match="remote must be a URL") as refused:
        RemoteTier(url, key=KEY)
    if "@" in url or "password=" in url:
        assert "hunter2" not in str(refused.value)
    assert "hunter2" not in redacted("rediss://user:hunter2-secret@host:1/0?password=hunter2-secret")


def test_weak_keys_are_refused_naming_the_fix(redis_server, monkeypatch) -> None:
    for weak in ("team", b"0123456789", "x" * 30):
        with pytest.raises(ValueError, match=r"remote_key is too weak.*os\.urandom\(16\)"):
            RemoteTier(redis_server.url, key=weak)
    monkeypatch.setenv("KVLIB_REMOTE_KEY", "team")
    with pytest.raises(ValueError, match=r"\$KVLIB_REMOTE_KEY is too weak"):
        RemoteTier(redis_server.url)


def test_tenants_with_different_keys_never_share_a_name(redis_server) -> None:
    """Records and queues are named from the key: another tenant's writes never overwrite this
    one's records, and its readers never see this one's messages."""
    mine, theirs = RemoteTier(redis_server.url, key=KEY), RemoteTier(redis_server.url, key=OTHER)
    mine.put_many([(b"k" * 32, b"ok-mine")])
    theirs.put_many([(b"k" * 32, b"ok-theirs")])
    assert mine.get_many([b"k" * 32], check) == [b"ok-mine"] and theirs.get_many([b"k" * 32], check) == [b"ok-theirs"]
    mine.push("default", b"my message")
    assert theirs.peek("default", 0.0) == [] and [bytes(mine.open_message("default", v, 1 << 20)) for v in mine.peek("default", 0.0)] == [
        b"my message"
    ]
    assert mine.queue_names("default") != theirs.queue_names("default") and mine.rejected == theirs.rejected == 0


def test_sealed_values_hide_what_they_carry_and_tagged_ones_do_not(redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    secret_prompt = b"the patient's diagnosis is"
    for encrypt, visible in ((True, False), (False, True)):
        tier = RemoteTier(redis_server.url, key=KEY, encrypt=encrypt)
        tier.put_many([(b"r" * 32, b"ok " + secret_prompt)])
        tier.push(f"q{encrypt}", secret_prompt)
        stored = client.get(tier.record_name(b"r" * 32)) + b"".join(client.lrange(tier.queue_names(f"q{encrypt}")[0], 0, -1))
        assert (secret_prompt in stored) == visible and tier.encrypted == encrypt
