"""Spill runs in a disk tier's directory: where their records and registrations live, the lock that
says a run is alive, and the sweep of runs that are not (done by every
:class:`~kvlib.storage.tiers.disk_tier.DiskTier` when it opens; the records themselves are
:mod:`~kvlib.storage.tiers.spill_store`'s).

Liveness is a lock, not a process id: a run holds an exclusive ``flock`` on its own lock file,
``runs/<run id hex>.lock`` in the tier's directory, from before it is registered until it is
closed; the kernel drops the lock when the process ends, however it ends (SIGKILL included). A
sweep judges a registered run dead when it can take that lock itself (or the file is gone), so
processes that share a directory judge each other right whatever PID namespaces they run in (a
container's pid 1 is another process outside it; a process id seen from another namespace means
nothing). The lock file is opened ``O_NOFOLLOW`` inside the tier's directory (which
:mod:`~kvlib.storage.tiers.lmdb_files` checked is this user's own). ``flock`` locks belong to the open
file: a child forked while a run is open holds it too, so the run counts as alive while the child
lives. Over NFS, ``flock`` is as good as the server's lock support.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

import lmdb

SPILL_DB = b"spill"
RUNS_DB = b"runs"
LOCKS = "runs"
"""The folder of run lock files inside a tier's directory."""
RUN_ENTRY = b"flock v1"
"""A run's registration: liveness is its lock file's ``flock`` (see the module docstring)."""


class RunLock:
    """The exclusive lock that says run ``run`` (16 bytes) in the tier at ``directory`` is alive:
    its lock file created and locked now, held until :meth:`release`. ``OSError`` if it cannot be."""

    def __init__(self, directory: Path, run: bytes) -> None:
        folder = Path(directory) / LOCKS
        folder.mkdir(mode=0o700, exist_ok=True)
        self.path = folder / f"{run.hex()}.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self.fd)
            self.fd = -1


def delete_run_records(txn: lmdb.Transaction, spill: lmdb._Database, run: bytes) -> None:
    """Delete every spill record of run ``run`` (its keys are contiguous) inside ``txn``."""
    cursor = txn.cursor(db=spill)
    if cursor.set_range(run):
        while cursor.key().startswith(run):
            if not cursor.delete():
                break


def sweep_dead_runs(env: lmdb.Environment, directory: Path) -> int:
    """Delete the spill records, registrations and lock files of runs no process holds the lock of
    (one transaction); returns how many runs were swept."""
    spill, runs = env.open_db(SPILL_DB), env.open_db(RUNS_DB)
    with env.begin(db=runs) as txn:
        registered = [bytes(run) for run, _ in txn.cursor()]
    dead: dict[bytes, int] = {}
    try:
        for run in registered:
            held = _take_if_dead(Path(directory) / LOCKS / f"{run.hex()}.lock")
            if held is not None:
                dead[run] = held
        if dead:
            with env.begin(write=True) as txn:
                for run in dead:
                    delete_run_records(txn, spill, run)
                    txn.delete(run, db=runs)
            for run in dead:
                with contextlib.suppress(OSError):
                    (Path(directory) / LOCKS / f"{run.hex()}.lock").unlink()
    finally:
        for fd in dead.values():
            if fd >= 0:
                os.close(fd)
    return len(dead)


def _take_if_dead(path: Path) -> int | None:
    """The lock of the run whose lock file is ``path``, taken (its file descriptor; -1 when the
    file is gone: dead too), or None when a live process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    except OSError:
        return None  # not ours to judge (a link planted there, no permission): left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd
