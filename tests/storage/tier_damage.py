"""Ways to damage a disk tier's directory, for the tests: cut, flipped bytes, a read-only directory."""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534
"""The user a root test process becomes to meet a read-only directory (root writes through modes)."""
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


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only for the block: its modes, and as root the effective user
    ``nobody`` (every ancestor of ``directory`` must let others through); restored after."""
    make_read_only(directory)
    root = os.geteuid() == 0
    try:
        if root:
            os.seteuid(NOBODY)
        yield
    finally:
        if root:
            os.seteuid(0)
        make_writable(directory)
