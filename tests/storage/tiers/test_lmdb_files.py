"""A damaged or unwritable disk tier directory never takes the process down: a data file cut short,
with a broken meta page or B-tree page is moved aside with one warning and the tier starts empty;
a directory that cannot hold a tier is a clear error; a file cut short while open makes reads
misses. (Through a prefix store and generate, in a subprocess: tests/adapters/cache/test_prefix_disk_damage.py.)"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlib.errors import DiskTierUnavailable
from kvlib.storage.tiers.disk_tier import DiskTier
from tests.storage.tier_damage import data_file, flip, main_root, page_size, read_only, truncate


def record(payload: bytes) -> bytes:
    return payload + hashlib.blake2b(payload, digest_size=16).digest()


def checked(parts: list[memoryview]) -> bytes:
    joined = b"".join(parts)
    if hashlib.blake2b(joined[:-16], digest_size=16).digest() != joined[-16:]:
        raise ValueError("checksum")
    return joined[:-16]


KEYS = [bytes([i]).ljust(32, b".") for i in range(12)]


@pytest.fixture
def tier_dir() -> Iterator[Path]:
    """A directory holding a tier of 12 records of 40 KB (about 130 lmdb pages), reachable by any
    user (a root test reads it as ``nobody`` to meet read-only modes)."""
    directory = Path(tempfile.mkdtemp(prefix="kvlib-tier-"))
    directory.chmod(0o755)
    tier = DiskTier(directory, capacity_bytes=1 << 22)
    assert tier.put_many([(key, record(os.urandom(40_000))) for key in KEYS])
    tier.close()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def reopened(directory: Path) -> tuple[DiskTier, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier = DiskTier(directory, capacity_bytes=1 << 22)
    return tier, caught


def assert_moved_aside_and_empty(directory: Path, match: str) -> None:
    tier, caught = reopened(directory)
    assert len(caught) == 1 and "data.mdb is damaged" in str(caught[0].message), [str(w.message) for w in caught]
    assert match in str(caught[0].message), str(caught[0].message)
    assert len(list(directory.glob("data.mdb.damaged-*"))) == 1 and len(list(directory.glob("lock.mdb.damaged-*"))) == 1
    assert tier.keys() == [] and tier.get(KEYS[0], checked) is None and tier.misses == 1
    assert tier.put(KEYS[0], record(b"new")) and tier.get(KEYS[0], checked) == b"new"  # a working, empty tier
    tier.close()
    assert reopened(directory)[1] == []  # the new file passes


def test_an_intact_directory_reopens_without_a_warning(tier_dir: Path) -> None:
    tier, caught = reopened(tier_dir)
    assert caught == [] and all(tier.get(key, checked) is not None for key in KEYS)
    tier.close()


@pytest.mark.parametrize("cut", ["8 KiB", "half", "last 4 KiB", "4 KiB", "100 bytes"])
def test_a_data_file_cut_short_is_moved_aside(tier_dir: Path, cut: str) -> None:
    size = data_file(tier_dir).stat().st_size
    length = {"8 KiB": 8192, "half": size // 2, "last 4 KiB": size - 4096, "4 KiB": 4096, "100 bytes": 100}[cut]
    truncate(tier_dir, length)
    assert_moved_aside_and_empty(tier_dir, "beyond EOF" if length >= 8192 else "beyond the end of the file")


def test_a_broken_meta_page_is_moved_aside(tier_dir: Path) -> None:
    flip(tier_dir, 16, 0xFF)  # meta page 0's magic
    assert_moved_aside_and_empty(tier_dir, "MDB_MAGIC")


@pytest.mark.parametrize("offset", [12, 17, 4000], ids=["mp_lower", "node pointer", "node"])
def test_a_broken_b_tree_page_is_moved_aside(tier_dir: Path, offset: int) -> None:
    """The main database's root page (the one naming the named databases): its bounds, a node
    pointer, a node's bytes (its key, size or flags)."""
    flip(tier_dir, main_root(tier_dir) * page_size(tier_dir) + offset, 0x21)
    assert_moved_aside_and_empty(tier_dir, "main")


def test_a_deleted_or_garbage_lock_file_is_recreated(tier_dir: Path) -> None:
    (tier_dir / "lock.mdb").unlink()
    tier, caught = reopened(tier_dir)
    assert caught == [] and tier.get(KEYS[3], checked) is not None
    tier.close()
    (tier_dir / "lock.mdb").write_bytes(os.urandom(8192))  # lmdb resets a lock file no process holds
    tier, caught = reopened(tier_dir)
    assert caught == [] and tier.get(KEYS[3], checked) is not None
    tier.close()


def test_a_read_only_directory_is_unavailable_and_left_alone(tier_dir: Path) -> None:
    with read_only(tier_dir), pytest.raises(DiskTierUnavailable, match=f"disk tier at {tier_dir}: lmdb cannot open it"):
        DiskTier(tier_dir, capacity_bytes=1 << 22)
    truncate(tier_dir, 8192)
    with read_only(tier_dir), pytest.raises(DiskTierUnavailable, match="is damaged .* cannot be moved aside"):
        DiskTier(tier_dir, capacity_bytes=1 << 22)
    assert sorted(path.name for path in tier_dir.iterdir()) == ["data.mdb", "lock.mdb"]


def test_a_directory_that_cannot_be_created_is_unavailable(tier_dir: Path) -> None:
    (tier_dir / "file").write_bytes(b"")
    with pytest.raises(DiskTierUnavailable, match="cannot create the directory"):
        DiskTier(tier_dir / "file" / "tier", capacity_bytes=1)


def test_a_data_file_cut_short_while_open_makes_reads_misses(tier_dir: Path) -> None:
    tier, _ = reopened(tier_dir)
    assert tier.get(KEYS[0], checked) is not None
    truncate(tier_dir, 8192)
    with pytest.warns(UserWarning, match="cut short while open") as caught:
        assert all(tier.get(key, checked) is None for key in KEYS)  # no SIGBUS: nothing of the map is read
        assert not tier.put(KEYS[0], record(b"late"))
    assert len(caught) == 1 and tier.lost and tier.misses == len(KEYS) and tier.reads == 1
    tier.close()


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_a_planted_symbolic_link_is_refused_and_its_target_left_alone(tmp_path: Path, name: str, target: str) -> None:
    """lmdb opens its files with O_CREAT and follows links: a link planted as ``lock.mdb`` made it
    truncate and overwrite the file it points to (another user's, or this user's own)."""
    victim = tmp_path / "victim"
    if target == "existing":
        victim.write_bytes(b"precious" * 1000)
    directory = tmp_path / "tier"
    directory.mkdir(mode=0o700)
    (directory / name).symlink_to(victim)
    with pytest.raises(DiskTierUnavailable, match=f"{name} is a symbolic link; refused"):
        DiskTier(directory, capacity_bytes=1 << 20)
    assert (victim.read_bytes() == b"precious" * 1000) if target == "existing" else not victim.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory or file to another user needs root")
def test_a_directory_of_another_user_or_writable_by_everyone_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    directory.mkdir(mode=0o700)
    for mode in (0o777, 0o1777, 0o1773):  # a sticky bit does not make it safe
        directory.chmod(mode)
        with pytest.raises(DiskTierUnavailable, match="writable by every user"):
            DiskTier(directory, capacity_bytes=1 << 20)
    directory.chmod(0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(DiskTierUnavailable, match="owned by uid 65534"):
        DiskTier(directory, capacity_bytes=1 << 20)
    os.chown(directory, 0, 0)
    (directory / "data.mdb").write_bytes(b"")
    os.chown(directory / "data.mdb", 65534, 65534)
    with pytest.raises(DiskTierUnavailable, match="data.mdb belongs to uid 65534"):
        DiskTier(directory, capacity_bytes=1 << 20)
    (directory / "data.mdb").unlink()
    (tmp_path / "elsewhere").write_bytes(b"")
    os.link(tmp_path / "elsewhere", directory / "lock.mdb")
    with pytest.raises(DiskTierUnavailable, match="lock.mdb has 2 links"):
        DiskTier(directory, capacity_bytes=1 << 20)
    link = tmp_path / "link"
    link.symlink_to(directory)
    os.lchown(link, 65534, 65534)
    with pytest.raises(DiskTierUnavailable, match="symbolic link of another user"):
        DiskTier(link, capacity_bytes=1 << 20)
    assert (tmp_path / "elsewhere").read_bytes() == b""
    (directory / "lock.mdb").unlink()
    tier = DiskTier(directory, capacity_bytes=1 << 20)  # this user's own directory, mode 0700
    assert tier.put(KEYS[0], record(b"ok")) and tier.get(KEYS[0], checked) == b"ok"
    assert all(stat_mode(directory / name) == 0o600 for name in ("data.mdb", "lock.mdb"))


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777
