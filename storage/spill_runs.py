"""Spill runs in a disk tier's lmdb environment: where their records and registrations live, and
the sweep of runs whose process is gone (done by every :class:`~kvlib.storage.disk_tier.DiskTier`
when it opens; the records themselves are :mod:`~kvlib.storage.spill_store`'s)."""

from __future__ import annotations

import os
import struct

import lmdb

SPILL_DB = b"spill"
RUNS_DB = b"runs"
RUN_ENTRY = struct.Struct("<QQ")
"""A run's registration: process id, process start time (clock ticks after boot; 0 if unknown)."""


def this_process_entry() -> bytes:
    """The registration of a run of this process (:data:`RUN_ENTRY`)."""
    pid = os.getpid()
    return RUN_ENTRY.pack(pid, _start_time(pid) or 0)


def delete_run_records(txn: lmdb.Transaction, spill: lmdb._Database, run: bytes) -> None:
    """Delete every spill record of run ``run`` (its keys are contiguous) inside ``txn``."""
    cursor = txn.cursor(db=spill)
    if cursor.set_range(run):
        while cursor.key().startswith(run):
            if not cursor.delete():
                break


def sweep_dead_runs(env: lmdb.Environment) -> int:
    """Delete the spill records and registrations of runs whose process is gone (one
    transaction); returns how many runs were swept."""
    spill, runs = env.open_db(SPILL_DB), env.open_db(RUNS_DB)
    with env.begin(db=runs) as txn:
        dead = [bytes(run) for run, value in txn.cursor() if not _alive(*RUN_ENTRY.unpack(value))]
    if dead:
        with env.begin(write=True) as txn:
            for run in dead:
                delete_run_records(txn, spill, run)
                txn.delete(run, db=runs)
    return len(dead)


def _alive(pid: int, start: int) -> bool:
    """Whether process ``pid`` started at ``start`` still runs (a zombie or a reused pid does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _start_time(pid)
    if now is None:
        return not os.path.isdir("/proc")  # no /proc: the signal check is all there is
    return start in (0, now)


def _start_time(pid: int) -> int | None:
    """Start time of live, non-zombie process ``pid`` (clock ticks after boot), from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])
