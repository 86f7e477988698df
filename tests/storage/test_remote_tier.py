"""The remote tier against a real server (Valkey from ``kvlib[remote]``): records round-trip in
pipelined batches; keyed records are read only with their key; a server killed, paused, restarted
or full makes counted misses, and the tier comes back with the server."""

from __future__ import annotations

import time

import pytest
import redis

from kvlib.storage.local_server import LocalServer
from kvlib.storage.remote_tier import PREFIX, RemoteTier


def check(record: memoryview) -> bytes:
    """A record check: records here must start with b"ok"."""
    if bytes(record[:2]) != b"ok":
        raise ValueError("not ok")
    return bytes(record)


def test_records_round_trip_in_one_batch(redis_server) -> None:
    tier = RemoteTier(redis_server.url)
    assert tier.put_many([(b"a" * 32, b"ok-first"), (b"b" * 32, memoryview(b"ok-second"))]) == 2
    assert tier.get_many([b"a" * 32, b"c" * 32, b"b" * 32], check) == [b"ok-first", None, b"ok-second"]
    assert tier.get_many([b"a" * 32], lambda record: check(b"no")) == [None]  # a failing check is a miss
    assert tier.stats() | {} == {
        "hits": 2,
        "misses": 2,
        "writes": 2,
        "corrupt": 1,
        "rejected": 0,
        "errors": 0,
        "write_errors": 0,
        "skipped": 0,
    }


def test_keyed_records_are_read_only_with_their_key(redis_server, monkeypatch) -> None:
    owner = RemoteTier(redis_server.url, key="secret")
    owner.put_many([(b"k" * 32, b"ok-owned")])
    assert owner.get_many([b"k" * 32], check) == [b"ok-owned"]
    for stranger in (RemoteTier(redis_server.url, key="other"), RemoteTier(redis_server.url)):
        assert stranger.get_many([b"k" * 32], check) == [None] and stranger.rejected == 1
    planter = RemoteTier(redis_server.url, key="other")  # plants a record under the owner's key
    planter.put_many([(b"k" * 32, b"ok-planted")])
    unkeyed = RemoteTier(redis_server.url)
    unkeyed.put_many([(b"u" * 32, b"ok-unkeyed")])
    assert owner.get_many([b"k" * 32, b"u" * 32], check) == [None, None] and owner.rejected == 2
    client = redis.Redis.from_url(redis_server.url)
    owner.put_many([(b"k" * 32, b"ok-owned")])
    client.copy(PREFIX + b"k" * 32, PREFIX + b"m" * 32)  # a valid record moved under another key
    value = bytearray(client.get(PREFIX + b"k" * 32))
    value[-1] ^= 1  # altered on the server
    client.set(PREFIX + b"k" * 32, bytes(value))
    assert owner.get_many([b"m" * 32, b"k" * 32], check) == [None, None] and owner.rejected == 4
    monkeypatch.setenv("KVLIB_REMOTE_KEY", "secret")
    assert RemoteTier(redis_server.url).keyed


def test_a_killed_server_is_a_counted_miss_until_it_returns(redis_server) -> None:
    tier = RemoteTier(redis_server.url, timeout_s=0.5, retry_s=0.2)
    tier.put_many([(b"a" * 32, b"ok")])
    redis_server.kill()
    assert tier.get_many([b"a" * 32], check) == [None] and tier.errors == 1
    assert tier.put_many([(b"a" * 32, b"ok")]) == 0 and tier.skipped == 1  # left alone for retry_s
    redis_server.start()  # empty again (no persistence)
    time.sleep(0.25)
    assert tier.put_many([(b"a" * 32, b"ok-again")]) == 1
    assert tier.get_many([b"a" * 32], check) == [b"ok-again"]


def test_a_paused_server_times_out_and_the_tier_comes_back(redis_server) -> None:
    tier = RemoteTier(redis_server.url, timeout_s=0.2, retry_s=0.2)
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


def test_a_full_server_refuses_writes_as_counted_write_errors() -> None:
    with LocalServer(maxmemory=2 << 20, policy="noeviction") as server:
        tier = RemoteTier(server.url)
        stored = sum(tier.put_many([(bytes([i]) * 32, b"ok" + bytes(256 << 10))]) for i in range(32))
        assert 0 < stored < 32 and tier.write_errors == 32 - stored and tier.errors == 0
        assert tier.get_many([bytes([0]) * 32], check)[0] is not None


def test_queues_carry_messages_between_tiers(redis_server) -> None:
    sender, receiver = RemoteTier(redis_server.url), RemoteTier(redis_server.url)
    assert receiver.pop("jobs", wait_s=0.05) is None
    assert sender.push("jobs", b"one") and sender.push("jobs", b"two")
    assert [receiver.pop("jobs", wait_s=0.1), receiver.pop("jobs", wait_s=0)] == [b"one", b"two"]


@pytest.mark.parametrize(
    "kwargs",
    [{"url": "http://x"}, {"url": "redis://x", "timeout_s": 0}, {"url": "redis://x", "retry_s": -1}, {"url": "redis://x", "key": ""}],
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
from kvlib.storage.remote_tier import RemoteTier
try:
    RemoteTier("redis://127.0.0.1:1")
except ImportError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "pip install 'kvlib[remote]'" in done.stdout
