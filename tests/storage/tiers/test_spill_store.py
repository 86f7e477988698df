"""Spilled pages: checked round trips, budgets, lost records, and clean-up on close and at start-up
(a SIGKILLed spiller's records go, a prefix store's records in the same directory stay)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvlib.errors import PoolExhaustedError
from kvlib.storage.records.spilled_page_record import Block, encode
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.spill_store import _RECORD_KEY, SpilledPageLost, SpillStore

REPO = Path(__file__).resolve().parents[3]


def pages(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.arange(3, 3 + count)
    keys, values = torch.randn(count, 4, 5, generator=generator), torch.randn(count, 4, 6, generator=generator)
    return ids, keys, values, torch.arange(count * 4).view(count, 4)


def test_pages_round_trip_stay_on_disk_when_read_and_go_when_deleted(tmp_path: Path) -> None:
    spill = SpillStore(DiskTier(tmp_path, capacity_bytes=1), capacity_bytes=1 << 20)
    layer = spill.layer(2, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)
    ids, keys, values, positions = pages(3)
    layer.put(ids, keys, values, positions)
    got_keys, got_values = layer.get(ids.flip(0), torch.device("cpu"))
    assert torch.equal(got_keys, keys.flip(0)) and torch.equal(got_values, values.flip(0))
    assert len(spill.keys()) == 3 and spill.nbytes > 0
    layer.delete(ids[:2])
    assert len(spill.keys()) == 1
    spill.close()
    assert spill.keys() == [] and spill.nbytes == 0


def test_past_the_budget_nothing_is_written_and_the_error_is_clear(tmp_path: Path) -> None:
    spill = SpillStore(DiskTier(tmp_path, capacity_bytes=1), capacity_bytes=500)
    layer = spill.layer(0, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)
    with pytest.raises(PoolExhaustedError, match="disk tier full"):
        layer.put(*pages(3))
    assert spill.keys() == [] and spill.nbytes == 0


def test_a_corrupt_or_missing_spilled_page_is_an_error_never_data(tmp_path: Path) -> None:
    spill = SpillStore(DiskTier(tmp_path, capacity_bytes=1), capacity_bytes=1 << 20)
    layer = spill.layer(0, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)
    ids, keys, values, positions = pages(2)
    layer.put(ids, keys, values, positions)
    key = spill.keys()[0]
    with spill.disk.env.begin(write=True) as txn:
        record = bytearray(txn.get(key, db=spill.spill))
        record[200] ^= 0x01
        txn.put(key, bytes(record), db=spill.spill)
    with pytest.raises(SpilledPageLost, match="fails its checks"):
        layer.get(ids, torch.device("cpu"))
    with pytest.raises(SpilledPageLost, match="no record"):
        layer.get(torch.tensor([99]), torch.device("cpu"))


def test_a_data_file_cut_short_while_open_loses_the_pages_without_a_crash(tmp_path: Path) -> None:
    spill = SpillStore(DiskTier(tmp_path, capacity_bytes=1), capacity_bytes=1 << 20)
    layer = spill.layer(0, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)
    ids, keys, values, positions = pages(40)
    layer.put(ids, keys, values, positions)
    os.truncate(tmp_path / "data.mdb", 8192)
    with pytest.warns(UserWarning, match="cut short while open"):
        with pytest.raises(SpilledPageLost, match="cut short while open"):
            layer.get(ids, torch.device("cpu"))  # no SIGBUS: nothing of the map is read
    layer.delete(ids)  # the records went with the file
    with pytest.raises(PoolExhaustedError, match="cut short while open"):
        layer.put(ids, keys, values, positions)


SPILLER = textwrap.dedent(
    """
    import sys, time, torch
    from kvlib import PagedStore, StoreConfig
    from kvlib.storage.tiers.disk_tier import DiskTier
    from kvlib.storage.tiers.spill_store import SpillStore
    disk = DiskTier(sys.argv[1], capacity_bytes=1 << 20)
    assert disk.put(b"p" * 32, b"a prefix record")
    store = PagedStore(StoreConfig(1, 1, 4, page_size=2, device_pages=2, host_pages=2, disk_pages=100),
                       spill=SpillStore(disk, capacity_bytes=1 << 20))
    seq = store.new_sequence()
    store.append(0, [seq], torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
    assert store.pools[0].pages_on_disk > 0
    print("spilled", flush=True)
    time.sleep(60)
    """
)


def test_a_killed_spillers_records_are_swept_at_start_up_and_prefix_records_survive(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", SPILLER, str(tmp_path)], stdout=subprocess.PIPE, cwd=REPO, text=True)
    try:
        assert child.stdout.readline().strip() == "spilled"
        alive = DiskTier(tmp_path, capacity_bytes=1 << 20)  # the spiller still runs: its records stay
        assert alive.swept_runs == 0 and _spilled(alive) > 0
        alive.close()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    reopened = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert reopened.swept_runs == 1 and _spilled(reopened) == 0
    assert reopened.keys() == [b"p" * 32] and reopened.raw(b"p" * 32) == b"a prefix record"
    reopened.close()


def _spilled(disk: DiskTier) -> int:
    """Spill records and registered runs in ``disk``."""
    with disk.env.begin() as txn:
        return txn.stat(disk.env.open_db(b"spill", txn=txn))["entries"] + txn.stat(disk.env.open_db(b"runs", txn=txn))["entries"]


def test_a_live_run_in_another_pid_namespace_is_never_swept(tmp_path: Path) -> None:
    """Containers sharing a volume: a spiller in its own PID namespace (its pid 1 is another process
    here) keeps its pages while it lives, and they go once it is killed. Liveness is its lock."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", SPILLER, str(tmp_path)]
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no new PID namespace here: {probe.stderr.decode().strip()}")
    child = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=REPO, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "spilled"
        for _ in range(2):  # opened twice while it lives: never swept
            alive = DiskTier(tmp_path, capacity_bytes=1 << 20)
            assert alive.swept_runs == 0 and _spilled(alive) > 1
            alive.close()
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 10
    while True:  # the namespace's processes end a moment after unshare itself
        reopened = DiskTier(tmp_path, capacity_bytes=1 << 20)
        if reopened.swept_runs or time.monotonic() > deadline:
            break
        reopened.close()
        time.sleep(0.05)
    assert reopened.swept_runs == 1 and _spilled(reopened) == 0 and list((tmp_path / "runs").iterdir()) == []
    reopened.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 2 MiB tmpfs mounted at a fresh folder (root only), unmounted after."""
    mount = tmp_path / "tmpfs"
    mount.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> None:
    """Fill the file system holding ``folder`` to its last byte (unbuffered writes, smaller and
    smaller, until each size is refused)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (64 << 10, 4096, 512, 1):
            try:
                while os.write(fd, bytes(size)) == size:
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def test_a_full_disk_while_spilling_is_pool_exhausted_and_the_store_stays_consistent(small_tmpfs: Path) -> None:
    disk = DiskTier(small_tmpfs / "tier", capacity_bytes=1 << 20)
    spill = SpillStore(disk, capacity_bytes=1 << 30)
    layer = spill.layer(0, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)
    stored = pages(8)
    layer.put(*stored)
    fill(small_tmpfs)
    with pytest.raises(PoolExhaustedError, match="cannot take spilled pages"):
        for seed in range(1, 200):  # until the disk refuses a commit
            more = pages(64, seed)
            layer.put(more[0] + 100 * seed, *more[1:])
    held = spill.keys()
    layer.delete(stored[0][:4])  # a full disk may refuse even a delete: never an lmdb error
    keys, values = layer.get(stored[0][4:], torch.device("cpu"))
    assert torch.equal(keys, stored[1][4:]) and torch.equal(values, stored[2][4:])
    assert len(spill.keys()) in (len(held), len(held) - 4)
    with pytest.raises(PoolExhaustedError, match="cannot (hold|register) a spill run"):
        SpillStore(disk, capacity_bytes=1 << 20)
    (small_tmpfs / "filler").unlink()
    layer.put(*pages(2, 99))  # room again: writing goes on
    spill.close()
    assert _spilled(disk) == 0
    disk.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_a_keyed_tier_never_uses_a_spilled_page_changed_without_its_key(tmp_path: Path, keyed: bool) -> None:
    """A valid record of other values (checksum and all) written over a spilled page by someone
    who can write the directory: an unkeyed tier returns it (it trusts the directory); a keyed one
    refuses it."""
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20, key=os.urandom(16) if keyed else None)
    layer = SpillStore(disk, capacity_bytes=1 << 20).layer(0, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)
    ids, keys, values, positions = pages(3)
    layer.put(ids, keys, values, positions)
    assert torch.equal(layer.get(ids, torch.device("cpu"))[0], keys)
    page = int(ids[1])
    forged = encode(layer.layout, Block(_RECORD_KEY.pack(0, page), b"", positions[1].tolist(), -keys[1][None, None], values[1][None, None]))
    with disk.env.begin(write=True) as txn:
        stored = txn.get(layer._key(page), db=layer.store.spill)
        txn.put(layer._key(page), bytes(forged) + bytes(stored)[len(forged) :], db=layer.store.spill)  # the old tag, if any, kept
    if keyed:
        with pytest.raises(SpilledPageLost, match="its tag is not this tier's key's"):
            layer.get(ids[1:2], torch.device("cpu"))
    else:
        assert torch.equal(layer.get(ids[1:2], torch.device("cpu"))[0][0], -keys[1])
