"""The lmdb disk tier: LRU within a byte budget, corrupt records are misses, a full map stops
writing with one warning, and a writer killed at random moments leaves no corrupt entry (records
split into parts: see also test_record_parts.py)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlib.errors import DiskTierUnavailable
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.open_tiers import open_disk_tier

DISK_TIER = Path(__file__).resolve().parents[3] / "storage" / "tiers" / "disk_tier.py"


def checked(parts: list[memoryview]) -> bytes:
    """A test record (its parts joined): payload + blake2b(payload); ValueError if they disagree."""
    record = b"".join(parts)
    payload, digest = record[:-16], record[-16:]
    if hashlib.blake2b(payload, digest_size=16).digest() != digest:
        raise ValueError("checksum")
    return payload


def record(payload: bytes) -> bytes:
    return payload + hashlib.blake2b(payload, digest_size=16).digest()


def test_put_get_and_lru_within_the_budget(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=3 * 1016)
    for name in (b"a", b"b", b"c"):
        assert tier.put(name.ljust(32, b"."), record(name * 1000))
    assert tier.get(b"a".ljust(32, b"."), checked) == b"a" * 1000  # a is now the most recent
    assert tier.put(b"d".ljust(32, b"."), record(b"d" * 1000))  # over budget: b (least recent) goes
    assert sorted(k[:1] for k in tier.keys()) == [b"a", b"c", b"d"]
    assert tier.nbytes <= tier.capacity_bytes and tier.evictions == 1
    assert tier.get(b"b".ljust(32, b"."), checked) is None and tier.misses == 1
    assert not tier.put(b"e".ljust(32, b"."), record(b"e" * 5000))  # larger than the budget: refused


def test_a_corrupt_record_is_a_counted_miss_and_is_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    key = b"k".ljust(32, b".")
    tier.put(key, record(b"x" * 100))
    data = bytearray(tier.raw(key))
    data[10] ^= 0x40
    tier.put(key, bytes(data))  # the tier stores what it is given: checking is the reader's
    assert tier.get(key, checked) is None
    assert tier.corrupt == 1 and tier.raw(key) is None and tier.nbytes == 0


def stored_parts(tier: DiskTier) -> int:
    with tier.env.begin() as txn:
        return txn.stat(tier.parts)["entries"]


def test_a_flipped_byte_in_any_part_is_a_counted_miss_and_every_part_goes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.part_bytes = 64  # many parts from a small record
    key, stored = b"k".ljust(32, b"."), record(os.urandom(300))
    parts = -(-len(stored) // 64)
    for index in range(parts):
        tier.put(key, [stored[:10], stored[10:]])  # chunks: cut into parts of 64 bytes, not joined first
        assert tier.raw(key) == stored and stored_parts(tier) == parts
        with tier.env.begin(write=True, db=tier.parts) as txn:
            part_key, value = list(txn.cursor())[index]
            value = bytearray(value)
            value[len(value) // 2] ^= 0x08
            txn.put(part_key, bytes(value))
        assert tier.get(key, checked) is None
        assert tier.raw(key) is None and stored_parts(tier) == 0 and tier.nbytes == 0
    assert tier.corrupt == parts


def test_replacing_and_evicting_records_keeps_exact_bytes_and_no_stale_part(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=3000)
    tier.part_bytes = 100
    sizes = {}
    for name, size in [(b"a", 900), (b"b", 700), (b"a", 150), (b"c", 1200), (b"d", 1000), (b"b", 80)]:
        key = name.ljust(32, b".")
        assert tier.put(key, record(os.urandom(size - 16)))
        sizes[key] = size
        held = {k: sizes[k] for k in tier.keys()}
        assert tier.nbytes == sum(held.values()) <= tier.capacity_bytes
        assert stored_parts(tier) == sum(-(-size // 100) for size in held.values())
        assert all(tier.get(k, checked) is not None for k in held)
    assert tier.evictions > 0


def test_an_entry_of_the_earlier_layout_is_a_counted_miss(tmp_path: Path) -> None:
    """A directory written by an earlier kvlib holds whole records as the entries' values."""
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(b"new".ljust(32, b"."), record(b"y" * 100))
    old, whole = b"old".ljust(32, b"."), record(b"x" * 100)
    with tier.env.begin(write=True) as txn:
        txn.put(old, whole, db=tier.records)
        txn.put(b"bytes", (tier.nbytes + len(whole)).to_bytes(8, "little"), db=tier.meta)
    assert tier.get(old, checked) is None and tier.corrupt == 1
    assert tier.keys() == [b"new".ljust(32, b".")] and tier.nbytes == 116


def test_a_full_map_stops_writing_with_one_warning(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=40 << 20)
    tier.limit = tier.env.info()["map_size"]  # pretend the disk cannot give the map more room
    with pytest.warns(UserWarning, match="stopped writing") as caught:
        for i in range(40):
            tier.put(i.to_bytes(32, "little"), record(os.urandom(1 << 20)))
    assert len(caught) == 1 and tier.stopped
    assert not tier.put(b"late".ljust(32, b"."), record(b"y"))


@pytest.mark.parametrize("change", ["removed", "replaced by another tier's directory", "data.mdb replaced"])
def test_a_directory_removed_or_replaced_while_open_stops_writing_and_a_new_store_opens_a_new_tier(tmp_path: Path, change: str) -> None:
    directory, other = tmp_path / "tier", tmp_path / "other"
    tier = open_disk_tier(directory, capacity_bytes=1 << 20)
    kept = b"k".ljust(32, b".")
    assert tier.put(kept, record(b"x" * 100))
    writer = DiskTier(other, capacity_bytes=1 << 20)
    writer.put(b"o".ljust(32, b"."), record(b"o" * 100))
    writer.close()
    if change == "removed":
        shutil.rmtree(directory)
    elif change == "replaced by another tier's directory":
        shutil.rmtree(directory)
        other.rename(directory)
    else:
        os.replace(other / "data.mdb", directory / "data.mdb")
    with pytest.warns(UserWarning, match="the directory was removed or its data.mdb replaced while open") as caught:
        assert not tier.put(b"a".ljust(32, b"."), record(b"a" * 100)) and not tier.put(b"b".ljust(32, b"."), record(b"b"))
    assert len(caught) == 1 and tier.detached and tier.writes == 1 and tier.dropped == 2  # counted as dropped, not as written
    assert tier.get(kept, checked) == b"x" * 100  # what the tier held is still read
    if change == "data.mdb replaced":  # the old lock file is still this process's: lmdb refuses to share it
        with pytest.raises(DiskTierUnavailable, match="lmdb cannot open it"):
            open_disk_tier(directory, capacity_bytes=1 << 20)
        return
    fresh = open_disk_tier(directory, capacity_bytes=1 << 20)
    assert fresh is not tier and [key[:1] for key in fresh.keys()] == ([] if change == "removed" else [b"o"])
    assert fresh.put(b"n".ljust(32, b"."), record(b"n"))
    fresh.close()
    assert DiskTier(directory, capacity_bytes=1 << 20).get(b"n".ljust(32, b"."), checked) == b"n"  # on disk for the next opener


WRITERS = f"""
import hashlib, importlib.util, os, random, sys
spec = importlib.util.spec_from_file_location("disk_tier", {str(DISK_TIER)!r})
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
for line in sys.stdin:  # one writer per line: a child forked from this process, which imported the tier once
    pid = os.fork()
    if pid == 0:
        tier = module.DiskTier(sys.argv[1], capacity_bytes=2 << 20)
        rng = random.Random(int(line))
        os.write(1, b"%d\\n" % os.getpid())
        while True:  # records of 1 to 8 parts, some keys rewritten, the budget churned by eviction
            payloads = [os.urandom(rng.randint(1, 256) * 1024) for _ in range(rng.randint(1, 3))]
            tier.put_many([(rng.randbytes(1).ljust(32, b"."), p + hashlib.blake2b(p, digest_size=16).digest()) for p in payloads])
    os.waitpid(pid, 0)
    os.write(1, b"gone\\n")
"""


def test_a_writer_killed_at_random_moments_leaves_no_corrupt_entry(tmp_path: Path) -> None:
    """Twenty writer processes, each killed (SIGKILL) at a random moment while it writes; each is
    forked from one process that imported the tier (a fresh interpreter per writer cost ~3 s)."""
    rng = random.Random(0)
    writers = subprocess.Popen([sys.executable, "-c", WRITERS, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for run in range(20):
            writers.stdin.write(b"%d\n" % run)
            writers.stdin.flush()
            pid = int(writers.stdout.readline())
            time.sleep(rng.uniform(0.01, 0.3))
            os.kill(pid, signal.SIGKILL)
            assert writers.stdout.readline().strip() == b"gone"
    finally:
        writers.stdin.close()
        writers.wait(timeout=60)
    tier = DiskTier(tmp_path, capacity_bytes=2 << 20)
    keys = tier.keys()
    assert keys, "the writers stored something"
    assert all(tier.get(key, checked) is not None for key in keys)
    assert tier.corrupt == 0 and tier.nbytes <= tier.capacity_bytes
    assert tier.nbytes == sum(len(tier.raw(key)) for key in keys)  # the byte count commits with the records
    with tier.env.begin() as txn:  # every part stored belongs to a whole record, and nothing else is
        parts = txn.stat(tier.parts)["entries"]
    assert parts == sum(-(-len(tier.raw(key)) // tier.part_bytes) for key in keys)


def test_a_keyed_tier_reads_only_records_tagged_with_its_key(tmp_path: Path, monkeypatch) -> None:
    """Anyone who can write the directory can write a record that passes its checksum; an unkeyed
    tier reads it (it trusts the directory), a keyed tier never does."""
    key = os.urandom(16)
    owner = DiskTier(tmp_path, capacity_bytes=1 << 20, key=key)
    assert owner.put_many([(b"a" * 32, record(b"genuine a")), (b"b" * 32, record(b"genuine b"))])
    assert owner.get(b"a" * 32, checked) == b"genuine a"
    owner.close()
    writer = DiskTier(tmp_path, capacity_bytes=1 << 20)  # no key: a user who can write the directory
    assert writer.get(b"a" * 32, checked) == b"genuine a"  # tags do not hide anything: records are not encrypted
    assert writer.put(b"a" * 32, record(b"forged a"))
    writer.close()
    other = DiskTier(tmp_path, capacity_bytes=1 << 20, key=os.urandom(16))
    assert other.get(b"b" * 32, checked) is None and other.corrupt == 1  # another key's tier: deleted as corrupt
    other.close()
    monkeypatch.setenv("KVLIB_DISK_KEY", key.hex())  # a passphrase is another secret than the raw bytes
    assert DiskTier(tmp_path, capacity_bytes=1 << 20).tag_key != owner.tag_key
    monkeypatch.delenv("KVLIB_DISK_KEY")
    again = DiskTier(tmp_path, capacity_bytes=1 << 20, key=key)
    assert again.get(b"a" * 32, checked) is None and again.corrupt == 1 and again.keys() == []
    assert again.put(b"c" * 32, record(b"genuine c")) and again.get(b"c" * 32, checked) == b"genuine c"
    shared = open_disk_tier(tmp_path / "shared", 1 << 20, key=key)
    assert open_disk_tier(tmp_path / "shared", 1 << 20, key=key) is shared
    with pytest.raises(ValueError, match="another disk key"):
        open_disk_tier(tmp_path / "shared", 1 << 20)
    with pytest.raises(ValueError, match=r"disk_key is too weak.*os\.urandom\(16\)"):
        DiskTier(tmp_path / "weak", capacity_bytes=1 << 20, key="team")
