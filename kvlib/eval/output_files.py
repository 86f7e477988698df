"""Files kvlib writes into a folder the user names (``--out`` of ``kvlib compare`` and the
benchmarks, the model cache): created so that nobody else with write access to the folder can
steer the write.

A folder such as ``/tmp/results`` may be shared: another user can plant a symbolic link (or a
file) under the name kvlib is about to write, and a plain ``open(path, "w")`` follows the link and
truncates whatever it points to. So every file here is written to a new file of a random name
made with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`tempfile.mkstemp`: it never opens what is
already there) and then renamed over its final name (``rename`` replaces a link planted there, it
never writes through it). A reader sees the old file or the new one whole. Folders of many files
(a converted model) are built in a private folder (:func:`tempfile.mkdtemp`, mode 0700) and
renamed into place. No fixed ``*.part`` name and no probe named by the process id are used.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

FILE_MODE = 0o644
"""Mode of a finished output file (readable by others, as results are meant to be)."""


def replace_file(path: Path, data: str | bytes) -> Path:
    """Write ``data`` (str: UTF-8, newlines as given) to ``path`` through a new file of a random
    name in its folder, renamed over ``path``; returns ``path``. ``OSError`` when the folder cannot
    take it (nothing is left behind then)."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            os.fchmod(handle.fileno(), FILE_MODE)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def check_writable(folder: Path) -> None:
    """``OSError`` unless a file can be created in ``folder`` (an unnamed one, gone at once)."""
    with tempfile.TemporaryFile(dir=folder):
        pass


def private_folder(next_to: Path) -> Path:
    """A new folder of a random name beside ``next_to`` (mode 0700), to build ``next_to`` in
    before it is renamed into place."""
    return Path(tempfile.mkdtemp(dir=next_to.parent, prefix=f".{next_to.name}."))
