"""Spilled pages: checked round trips, budgets, lost records, and clean-up on close and at start-up
(a SIGKILLed spiller's records go, a prefix store's records in the same directory stay)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvlib.errors import PoolExhaustedError
from kvlib.storage.disk_tier import DiskTier
from kvlib.storage.spill_store import SpilledPageLost, SpillStore

REPO = Path(__file__).resolve().parents[2]


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
    from kvlib.storage.disk_tier import DiskTier
    from kvlib.storage.spill_store import SpillStore
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
