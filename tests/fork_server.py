"""A fork server for tests that need a fresh process per run: one interpreter imports torch and
kvlib and warms up once; each run is a child forked from it (a fresh interpreter per run costs
~10 s of imports and kernel loading here), so a crash (SIGBUS, abort) kills the child only and
shows as its exit status, and children share nothing but what the server did before forking.

The server's code (:class:`ForkServer`'s ``code``) defines ``ready()``, run once before any fork
(its JSON-able result is :attr:`ForkServer.ready`), and ``serve(request)``, run in each child on
a JSON-able request, returning a JSON-able result. Threading is made fork-safe before anything is
imported: torch on one thread, kvlib's numba kernels on numba's workqueue layer (GNU OpenMP
refuses to run in a child forked from a process that used it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PREAMBLE = """
import json, os, sys
os.environ["NUMBA_THREADING_LAYER"] = "workqueue"
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
"""

_LOOP = """
print(json.dumps(ready()), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, json.dumps(serve(request)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status), "result": json.loads(answer) if answer else None}), flush=True)
"""


class ForkServer:
    """The server process running ``code`` (see the module docstring), started from the checkout's root."""

    def __init__(self, code: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PREAMBLE.format(repo=str(REPO)) + code + _LOOP],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.ready = json.loads(self.process.stdout.readline())
        """What ``ready()`` returned."""

    def ask(self, request: object) -> dict:
        """Run ``serve(request)`` in a new child: ``{"exit": its exit code (negative: the signal that
        killed it), "result": what it returned (None if it returned nothing)}``."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
