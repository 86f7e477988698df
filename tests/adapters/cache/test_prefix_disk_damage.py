"""A prefix store over a damaged disk tier directory: whatever the damage (cut at any length,
random bytes flipped in any page, the lock file deleted, the directory read-only), a process
that looks up a prompt and generates exits normally and generates exactly what it generates with
no disk tier.

Each run is its own process, forked from a server that imported torch and kvlib and built the
model once (a fresh interpreter per run would cost ~10 s of imports here): a SIGBUS or abort
kills the child only and shows as its exit status. A read-only directory's child drops the
capability to write through file modes and stays the same user (:mod:`tests.storage.tier_damage`),
so it imports what it needs wherever the checkout lives (a child turned ``nobody`` could not read
a virtual environment under a private ``/root``), and reports whether it could still write there:
the test fails, never passes silently, when it could.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fork_server import ForkServer
from tests.storage.tier_damage import data_file, flip, make_read_only, make_writable, page_size, truncate

SERVER = """
import warnings
import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model
from tests.storage.tier_damage import writable, write_through_modes

model = build_model("default")
prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))


def run(disk):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)
        cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
        reused = cache.get_seq_length()
        out = model.generate(prompt, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    return {"tokens": out[0].tolist(), "reused": reused, "disk": store.disk.stats() if store.disk else None,
            "warnings": [str(w.message) for w in caught]}


def ready():
    return run(None)  # the reference, and a warm-up the children inherit


def serve(request):
    if request["read_only"]:
        write_through_modes(False)
    return run(request["disk"]) | {"writable": writable(request["disk"])}
"""


class Runs:
    """:meth:`run` looks up and generates in a fresh child process (:class:`~tests.fork_server.ForkServer`)."""

    def __init__(self) -> None:
        self.server = ForkServer(SERVER)
        self.reference = self.server.ready

    def run(self, disk: Path, read_only: bool = False) -> dict:
        """The child's exit code (negative: the signal that killed it) and what it reported
        (``writable``: whether it could create a file in ``disk``); with ``read_only`` the child
        cannot write through file modes, even as root."""
        return self.server.ask({"disk": str(disk), "read_only": read_only})

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    server = Runs()
    yield server
    server.close()


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A directory for the tier copies."""
    directory = Path(tempfile.mkdtemp(prefix="kvlib-damage-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def written(runs: Runs, scratch: Path) -> Path:
    """A tier directory holding the prompt's four blocks, as a first process leaves it."""
    directory = scratch / "written"
    first = runs.run(directory)
    assert first["exit"] == 0 and first["result"]["disk"]["writes"] == 4
    assert first["result"]["tokens"] == runs.reference["tokens"]
    return directory


Damage = tuple
"""``("cut", fraction of the file)``, ``("cut_to", bytes)``, ``("cut_by", bytes)``, ``("flip",
fraction of the pages, offset in the page, xor mask)``, ``("record", which record)`` (a byte of a
stored record's page data), ``("unlock",)`` (delete the lock file) or ``("read_only",)``."""

DAMAGE = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.sampled_from(["cut_to", "cut_by"]), st.sampled_from([1, 4096, 8192])),
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.one_of(st.integers(0, 63), st.integers(0, 4095)), st.integers(1, 255)),
    st.tuples(st.just("record"), st.integers(0, 3)),
    st.just(("unlock",)),
    st.just(("read_only",)),
)


def damaged_copy(source: Path, into: Path, damage: list[Damage]) -> bool:
    """``source`` copied to ``into`` with ``damage`` done to it in order; returns whether it was
    made read-only."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(source, into)
    read_only = False
    for kind, *args in damage:
        size = data_file(into).stat().st_size
        if kind == "cut":
            truncate(into, int(args[0] * size))
        elif kind == "cut_to":
            truncate(into, min(args[0], size))
        elif kind == "cut_by":
            truncate(into, max(0, size - args[0]))
        elif kind == "flip" and size:
            psize = page_size(source)
            page = int(args[0] * -(-size // psize))
            flip(into, min(page * psize + args[1] % psize, size - 1), args[2])
        elif kind == "record":
            content, at = data_file(into).read_bytes(), -1
            for _ in range(args[0] + 1):
                at = content.find(b"KVLP", at + 1)
                if at < 0:
                    break
            if at >= 0:
                flip(into, at + 500, 0x10)
        elif kind == "unlock":
            (into / "lock.mdb").unlink(missing_ok=True)
        elif kind == "read_only":
            read_only = True
    if read_only:
        make_read_only(into)
    return read_only


@settings(max_examples=30, deadline=None)
@given(damage=st.lists(DAMAGE, min_size=1, max_size=3))
@example(damage=[("cut_to", 8192)])
@example(damage=[("cut", 0.5)])
@example(damage=[("cut_by", 4096)])
@example(damage=[("cut_to", 4096)])
@example(damage=[("read_only",)])
@example(damage=[("unlock",), ("flip", 0.0, 16, 0xFF)])
def test_a_damaged_directory_never_fails_a_process_nor_changes_its_output(
    runs: Runs, written: Path, scratch: Path, damage: list[Damage]
) -> None:
    directory = scratch / "damaged"
    read_only = damaged_copy(written, directory, damage)
    try:
        outcome = runs.run(directory, read_only)
    finally:
        make_writable(directory)
    assert outcome["exit"] == 0, (damage, outcome)
    assert outcome["result"]["tokens"] == runs.reference["tokens"], (damage, outcome)
    assert outcome["result"]["writable"] != read_only, (damage, "the child could write to the read-only directory")


def test_a_flipped_byte_in_a_record_is_a_counted_miss(runs: Runs, written: Path, scratch: Path) -> None:
    directory = scratch / "one-record"
    damaged_copy(written, directory, [("record", 2)])
    outcome = runs.run(directory)
    assert outcome["exit"] == 0 and outcome["result"]["tokens"] == runs.reference["tokens"]
    assert outcome["result"]["disk"]["corrupt"] == 1 and outcome["result"]["warnings"] == []
    assert outcome["result"]["reused"] < 64  # the blocks before the damaged one
