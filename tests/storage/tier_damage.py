"""Ways to damage a disk tier's directory, for the tests: cut, flipped bytes, a read-only directory.

A read-only directory needs a process that cannot write through file modes. Root can: the
capability ``CAP_DAC_OVERRIDE``. So a root process drops it from its effective set
(:func:`write_through_modes`) instead of becoming another user: it stays root, owns and reads
everything it did (a virtual environment under a private ``/root`` included: a process turned
``nobody`` could not import what it had not imported yet), and a mode without ``w`` refuses it.
:func:`writable` tells whether that worked, so a test asserts it rather than passing without a
read-only directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from collections.abc import Iterator
from pathlib import Path

CAP_DAC_OVERRIDE = 1
"""The Linux capability that lets a process read, write and enter files and directories whatever their modes."""
_CAPABILITY_VERSION_3 = 0x20080522
"""``_LINUX_CAPABILITY_VERSION_3``: two 32-bit words per set."""


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Sets(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_META_TXNID, _MAIN_ROOT = 144, 128
"""Byte offsets in an lmdb 0.9 meta page (64-bit): the transaction id, the main database's root page."""


def data_file(directory: Path) -> Path:
    return Path(directory) / "data.mdb"


def page_size(directory: Path) -> int:
    """lmdb's page size, from meta page 0 (the free database's ``md_pad``)."""
    with open(data_file(directory), "rb") as handle:
        return struct.unpack_from("<I", handle.read(64), 40)[0]


def main_root(directory: Path) -> int:
    """The page number of the main database's root (the B-tree page naming the named databases),
    from the newer meta page."""
    psize = page_size(directory)
    with open(data_file(directory), "rb") as handle:
        metas = [handle.read(psize) for _ in range(2)]
    newest = max(metas, key=lambda meta: struct.unpack_from("<Q", meta, _META_TXNID)[0])
    return struct.unpack_from("<Q", newest, _MAIN_ROOT)[0]


def flip(directory: Path, offset: int, mask: int) -> None:
    """XOR byte ``offset`` of ``data.mdb`` with ``mask`` (1..255)."""
    with open(data_file(directory), "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))


def truncate(directory: Path, length: int) -> None:
    os.truncate(data_file(directory), length)


def make_read_only(directory: Path) -> None:
    """Modes a+rx on the directory, a+r on its files, nothing writable."""
    directory = Path(directory)
    for path in directory.iterdir():
        path.chmod(0o444)
    directory.chmod(0o555)


def make_writable(directory: Path) -> None:
    directory = Path(directory)
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def write_through_modes(allowed: bool) -> None:
    """Raise (``allowed``, if the process holds it in its permitted set) or drop
    ``CAP_DAC_OVERRIDE`` in this process's effective capabilities (``capget``/``capset``, Linux);
    ``OSError`` if the kernel refuses. A process without it (not root) is unchanged."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, sets = _Header(_CAPABILITY_VERSION_3, 0), (_Sets * 2)()
    if libc.capget(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    word, bit = divmod(CAP_DAC_OVERRIDE, 32)
    if allowed:
        sets[word].effective |= sets[word].permitted & (1 << bit)
    else:
        sets[word].effective &= ~(1 << bit) & 0xFFFFFFFF
    if libc.capset(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def writable(directory: Path) -> bool:
    """Whether this process can create a file in ``directory`` (probed, and removed again)."""
    probe = Path(directory) / f".kvlib-probe-{os.getpid()}"
    try:
        probe.touch(exist_ok=False)
    except OSError:
        return False
    probe.unlink()
    return True


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only for this process during the block: its modes, and
    ``CAP_DAC_OVERRIDE`` dropped (:func:`write_through_modes`); ``AssertionError`` if the process
    can still write there. Restored after."""
    make_read_only(directory)
    try:
        write_through_modes(False)
        assert not writable(directory), f"this process can still write to {directory}: no read-only directory to test"
        yield
    finally:
        write_through_modes(True)
        make_writable(directory)
