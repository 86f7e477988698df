"""The disk tier's lmdb files: verified before lmdb reads them, moved aside when damaged.

lmdb maps ``data.mdb`` and trusts what it finds there. A file cut short (an interrupted copy, a
disk that filled at the wrong moment) makes the first read past its end a SIGBUS, which kills
the process; a damaged B-tree page can send lmdb's reads and writes anywhere. So
:func:`open_environment` lets lmdb touch no page before the file has passed
:func:`lmdb.verify.verify` (py-lmdb's offline verifier: every page reachable from the committed
meta page lies within the file, stores its own number, has sound bounds, sorted keys and true
counters; the free list and the reachable pages are disjoint and cover the file's pages), run
while a read transaction pins the snapshot it checks (so a writer in another process cannot
reuse its pages meanwhile).

Whose directory: lmdb opens ``data.mdb`` and ``lock.mdb`` with ``O_CREAT`` and follows symbolic
links, so a user who can write the directory could point them at any file this process can write
(and lmdb would truncate and overwrite it). So before lmdb sees a directory it must be this
process's: owned by its effective user (a directory path that is itself a symbolic link must be
one of its own links), and not writable by every user (mode ``o+w``; the sticky bit does not
make it safe: another user can still create ``data.mdb`` or ``lock.mdb`` there first); and the
two files, created here if missing (``O_CREAT | O_NOFOLLOW``, mode 0600), must be regular files
of this user with one link each (no symbolic link, no hard link to another file). The files
are held open while lmdb opens them, and lmdb's files must then be those same files (device and
inode), or the environment is closed and refused. A refused directory is
:class:`~kvlib.errors.DiskTierUnavailable` naming the problem; what such a directory holds is
never touched. A group-writable directory is allowed: a group that shares a cache is trusted
with it (a key on the tier makes its records tamper-evident: :class:`~kvlib.storage.tiers.disk_tier.DiskTier`).

What happens to a directory:

- fine: the environment is returned;
- its ``data.mdb`` fails the verifier or is shorter than the pages of its last commit (the
  verifier lets a free page at the end be missing), or lmdb cannot open it and the verifier finds
  it damaged:
  ``data.mdb`` and ``lock.mdb`` are renamed ``<name>.damaged-<UTC time>-<pid>`` beside it (a
  process still using them keeps them), one warning says so, and an empty environment is
  opened: a cache directory loses its contents, never the process;
- it cannot be created or written (a read-only file system or directory, missing permission),
  lmdb cannot open it for another reason while the verifier finds nothing wrong with
  ``data.mdb``, or its damaged files cannot be moved aside:
  :class:`~kvlib.errors.DiskTierUnavailable`, naming the directory and the cause.
  Callers decide: a prefix store goes on without a disk tier, a spilling cache refuses to start.

Cost: the verifier is pure Python and reads every B-tree page and the first page of every
record part (one part per 32 KB of records), at every opening of a directory by a process: 1,200
records of 394 KB (474 MB) took 0.15-0.2 s here with the file in the page cache, 0.6-0.8 s with
other jobs loading the machine or the file read from disk.

What remains: a file damaged while a process has it open. The disk tier compares the size of the
file it opened with :func:`committed_bytes` before each read (an ``fstat``, :meth:`DiskTier.intact
<kvlib.storage.tiers.disk_tier.DiskTier.intact>`), so a file truncated since is noticed; a truncation
between that check and the read, or bytes flipped in B-tree pages after the opening, are not
caught (py-lmdb's own bounds checks turn much of the latter into errors).
"""

from __future__ import annotations

import datetime
import errno
import os
import stat
import warnings
from pathlib import Path

import lmdb
import lmdb.verify

from kvlib.errors import DiskTierUnavailable

FILES = ("data.mdb", "lock.mdb")
"""The files of an lmdb environment directory (``subdir=True``)."""


def open_environment(directory: Path, map_size: int, max_dbs: int) -> lmdb.Environment:
    """The lmdb environment in ``directory`` (created if missing), its ``data.mdb`` verified;
    damaged files moved aside with one warning (then empty); :class:`DiskTierUnavailable` if the
    directory cannot hold one. See the module docstring."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:
        raise DiskTierUnavailable(f"disk tier at {directory}: cannot create the directory ({_reason(error)})") from None
    check_directory(directory)
    try:
        env = _open(directory, map_size, max_dbs)
    except lmdb.Error as error:
        damage = _damage(directory)
        if damage is None:
            raise DiskTierUnavailable(f"disk tier at {directory}: lmdb cannot open it ({_reason(error)})") from None
    else:
        with env.begin():  # pins the snapshot the verifier checks (see the module docstring)
            damage = _damage(directory) or _short(directory, env)
        if damage is None:
            return env
        env.close()
    aside = _move_aside(directory, damage)
    warnings.warn(
        f"kvlib disk tier at {directory}: data.mdb is damaged ({damage}); moved it aside to {aside} and started empty", stacklevel=3
    )
    try:
        return _open(directory, map_size, max_dbs)
    except lmdb.Error as error:
        raise DiskTierUnavailable(f"disk tier at {directory}: lmdb cannot open it ({_reason(error)})") from None


def _open(directory: Path, map_size: int, max_dbs: int) -> lmdb.Environment:
    """lmdb's environment on ``directory``'s files, pinned first (:func:`pinned_files`) and
    checked to be the files lmdb opened; :class:`DiskTierUnavailable` if either fails."""
    pinned = pinned_files(directory)
    try:
        env = lmdb.open(str(directory), map_size=map_size, max_dbs=max_dbs, subdir=True)
        try:
            for name, (fd, _) in pinned.items():
                now, held = os.lstat(directory / name), os.fstat(fd)
                if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                    raise DiskTierUnavailable(f"disk tier at {directory}: {name} was replaced while the tier opened it; refused")
        except BaseException:
            env.close()
            raise
        return env
    finally:
        for fd, _ in pinned.values():
            os.close(fd)


def check_directory(directory: Path) -> None:
    """:class:`DiskTierUnavailable` unless ``directory`` is this process's to hold a tier in (see
    the module docstring: owned by this effective user, not writable by every user, not a
    symbolic link of another user)."""
    me = os.geteuid()
    try:
        link = os.lstat(directory)
        held = os.stat(directory)
    except OSError as error:
        raise DiskTierUnavailable(f"disk tier at {directory}: cannot read the directory ({_reason(error)})") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise DiskTierUnavailable(f"disk tier at {directory}: the path is a symbolic link of another user (uid {link.st_uid}); refused")
    if held.st_uid != me:
        raise DiskTierUnavailable(
            f"disk tier at {directory}: the directory is owned by uid {held.st_uid}, not by this process's user (uid {me}):"
            " its owner could point the tier's files anywhere; use a directory of your own"
        )
    if held.st_mode & stat.S_IWOTH:
        raise DiskTierUnavailable(
            f"disk tier at {directory}: the directory is writable by every user (mode {stat.S_IMODE(held.st_mode):#o}; a sticky"
            " bit does not help: anyone can create data.mdb or lock.mdb there first); use a directory of your own (mode 0700)"
        )


def pinned_files(directory: Path) -> dict[str, tuple[int, os.stat_result]]:
    """``directory``'s lmdb files, opened (created if missing, mode 0600) without following a
    symbolic link: file descriptor and status by name. :class:`DiskTierUnavailable` for a
    symbolic link, anything but a regular file, a file of another user or with another link."""
    pinned: dict[str, tuple[int, os.stat_result]] = {}
    try:
        for name in FILES:
            try:
                fd = os.open(directory / name, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise DiskTierUnavailable(f"disk tier at {directory}: {name} is a symbolic link; refused (remove it)") from None
                raise DiskTierUnavailable(f"disk tier at {directory}: lmdb cannot open it ({name}: {_reason(error)})") from None
            held = os.fstat(fd)
            pinned[name] = (fd, held)
            if not stat.S_ISREG(held.st_mode):
                raise DiskTierUnavailable(f"disk tier at {directory}: {name} is not a regular file; refused")
            if held.st_uid != os.geteuid():
                raise DiskTierUnavailable(
                    f"disk tier at {directory}: {name} belongs to uid {held.st_uid}, not to this process's user; refused"
                )
            if held.st_nlink != 1:
                raise DiskTierUnavailable(
                    f"disk tier at {directory}: {name} has {held.st_nlink} links (a hard link to another file?); refused"
                )
    except BaseException:
        for fd, _ in pinned.values():
            os.close(fd)
        raise
    return pinned


def _damage(directory: Path) -> str | None:
    """What the verifier finds wrong with ``directory``'s ``data.mdb`` (its first findings), or
    None if it passes or is absent or empty (lmdb starts a new one);
    :class:`DiskTierUnavailable` if it cannot be read."""
    data = directory / "data.mdb"
    try:
        if not data.exists() or data.stat().st_size == 0:
            return None
        problems = lmdb.verify.verify(str(data), subdir=False)
    except lmdb.verify.VerifyError as error:
        return str(error)
    except OSError as error:
        raise DiskTierUnavailable(f"disk tier at {directory}: cannot read data.mdb ({_reason(error)})") from None
    return None if not problems else "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")


def _move_aside(directory: Path, damage: str) -> str:
    """Rename ``directory``'s lmdb files with one ``.damaged-<UTC time>-<pid>`` suffix; returns
    the data file's new name. :class:`DiskTierUnavailable` if they cannot be renamed."""
    suffix = f".damaged-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"
    for name in FILES:
        try:
            os.rename(directory / name, directory / (name + suffix))
        except FileNotFoundError:
            continue
        except OSError as error:
            raise DiskTierUnavailable(
                f"disk tier at {directory}: data.mdb is damaged ({damage}) and cannot be moved aside ({_reason(error)})"
            ) from None
    return "data.mdb" + suffix


def _short(directory: Path, env: lmdb.Environment) -> str | None:
    """Why ``directory``'s ``data.mdb`` is shorter than the pages of lmdb's newest commit, or None."""
    size, needed = (directory / "data.mdb").stat().st_size, committed_bytes(env, env.stat()["psize"])
    return f"{size} bytes, its last commit's pages span {needed}" if size < needed else None


def committed_bytes(env: lmdb.Environment, psize: int) -> int:
    """Bytes of ``data.mdb`` that the pages of lmdb's newest commit span (``psize``: its page size):
    a shorter file makes a read of the last pages a SIGBUS."""
    return (env.info()["last_pgno"] + 1) * psize


def _reason(error: Exception) -> str:
    """A short cause: ``strerror`` for OS errors, lmdb's message otherwise."""
    if isinstance(error, OSError) and error.errno is not None:
        return f"{errno.errorcode.get(error.errno, error.errno)}: {error.strerror}"
    return f"{type(error).__name__}: {error}"
