"""Reading a JSON Lines task file in bounded pieces: one object per line, checked as it is read.

The file must be a regular file of at most :data:`~kvlib.limits.MAX_TASK_FILE_BYTES`; each line is
read with a cap of :data:`MAX_LINE_BYTES` (``readline(cap + 1)``), so a line of hundreds of MB (or a
file of zeros with no newline) is refused after reading at most the cap, never read whole. Every
problem (not UTF-8, not JSON, a NaN, nesting past the parser's depth, not an object, a line too
long, a Parquet file given as JSON Lines) is a ``ValueError`` naming the file and the line.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from kvlib.errors import cut, quoted
from kvlib.limits import MAX_TASK_FILE_BYTES

MAX_LINE_BYTES = 64 * 2**20
"""Longest line read (64 MiB): a task line is one example, whose context is at most a few MB of
text even at a million tokens."""
PARQUET_MAGIC = b"PAR1"
"""The first (and last) four bytes of a Parquet file."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def open_task_file(path: str | Path, what: str):
    """``path`` opened for binary reading; ``ValueError`` naming ``what`` unless it is a regular
    file (opened without blocking, so a pipe or device is refused) of at most
    :data:`~kvlib.limits.MAX_TASK_FILE_BYTES`."""
    name = quoted(str(path))
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{what} not found: {path}") from None
    except OSError as error:
        raise ValueError(f"cannot read {what} {name}: {error.strerror or error}") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise ValueError(f"{what} {name} is not a regular file")
    if info.st_size > MAX_TASK_FILE_BYTES:
        os.close(descriptor)
        raise ValueError(f"{what} {name} holds more than {MAX_TASK_FILE_BYTES} bytes, the most a {what} may hold")
    return os.fdopen(descriptor, "rb")


def json_lines(path: str | Path, what: str = "jsonl file", max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, dict]]:
    """``(where, object)`` for every non-blank line of the JSON Lines file at ``path``, ``where``
    being ``"path:line"``; see the module docstring for what is refused."""
    with open_task_file(path, what) as handle:
        if handle.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC:
            raise ValueError(f"{path} is a Parquet file, not JSON Lines")
        handle.seek(0)
        for number, raw in enumerate(iter(lambda: handle.readline(max_line_bytes + 1), b""), start=1):
            where = f"{path}:{number}"
            if len(raw) > max_line_bytes:
                raise ValueError(f"{where}: a line longer than {max_line_bytes} bytes (the most a task line may hold)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_constant=_no_constant)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{where}: not a task line ({cut(str(exc)) or 'nested too deep'})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object per line")
            yield where, record
