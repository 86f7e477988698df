"""Records stored as parts: chunks cut into parts in order, and every way a part set can be
incomplete, misplaced or stale is refused or cleaned up."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest

from kvlib.storage.records import record_parts

PART = 100


@pytest.fixture
def env(tmp_path: Path):
    environment = lmdb.open(str(tmp_path), map_size=1 << 24, max_dbs=2)
    yield environment, environment.open_db(b"records"), environment.open_db(b"parts")
    environment.close()


def put(env, key: bytes, *chunks: bytes) -> int:
    environment, entries, parts = env
    with environment.begin(write=True) as txn:
        return record_parts.put(txn, entries, parts, key, [memoryview(chunk) for chunk in chunks], PART)


def read(env, key: bytes) -> bytes | None:
    environment, entries, parts = env
    with environment.begin(buffers=True) as txn:
        found = record_parts.read(txn, entries, parts, key)
        return None if found is None else b"".join(found)


def stored_parts(env) -> list[tuple[bytes, bytes]]:
    environment, _, parts = env
    with environment.begin(db=parts) as txn:
        return list(txn.cursor())


def test_chunks_are_cut_into_full_parts_in_order_and_read_back_joined(env) -> None:
    head, body, tail = os.urandom(30), os.urandom(250), os.urandom(8)
    assert put(env, b"k", head, body, tail) == 0
    assert read(env, b"k") == head + body + tail
    assert [len(value) for _, value in stored_parts(env)] == [100, 100, 88]  # parts span chunks
    assert put(env, b"k", b"", os.urandom(200), b"") == 288 and [len(v) for _, v in stored_parts(env)] == [100, 100]
    assert read(env, b"absent") is None


def test_a_missing_misplaced_or_resized_part_is_not_a_record(env) -> None:
    environment, _, parts = env
    for damage in ("delete", "grow", "move"):
        put(env, b"k", os.urandom(350))
        keys = [key for key, _ in stored_parts(env)]
        with environment.begin(write=True, db=parts) as txn:
            if damage == "delete":
                txn.delete(keys[1])
            elif damage == "grow":
                txn.put(keys[1], txn.get(keys[1]) + b"x")
            else:  # the last part under the next index: one missing, one past the count
                txn.put(keys[-1][:-1] + bytes([keys[-1][-1] + 1]), txn.pop(keys[-1]))
        with pytest.raises(ValueError, match="parts"):
            read(env, b"k")


def test_an_entry_of_another_layout_is_not_a_record_and_counts_its_own_length(env) -> None:
    environment, entries, parts = env
    whole = os.urandom(500)  # an earlier kvlib's record: the whole record as the entry's value
    with environment.begin(write=True) as txn:
        txn.put(b"k", whole, db=entries)
    with pytest.raises(ValueError, match="layout"):
        read(env, b"k")
    assert record_parts.record_bytes(whole) == 500
    with environment.begin(write=True) as txn:
        assert record_parts.delete(txn, entries, parts, b"k") == 500


def test_replacing_with_fewer_parts_or_deleting_leaves_no_part_behind(env) -> None:
    environment, entries, parts = env
    put(env, b"k", os.urandom(450))
    assert put(env, b"k", b"short") == 450  # the replaced record's bytes
    assert read(env, b"k") == b"short" and len(stored_parts(env)) == 1
    with environment.begin(write=True) as txn:
        assert record_parts.delete(txn, entries, parts, b"k") == 5
        assert record_parts.delete(txn, entries, parts, b"k") == 0
    assert stored_parts(env) == [] and read(env, b"k") is None


def test_keys_that_extend_other_keys_keep_their_parts_apart(env) -> None:
    environment, entries, parts = env
    short, extended = b"a", b"a\x00\x00\x00\x00\x01"  # the extension looks like a part index of "a"
    data = {short: os.urandom(330), extended: os.urandom(210), b"a\x00": b""}
    for key, value in data.items():
        put(env, key, value)
    assert all(read(env, key) == value for key, value in data.items())
    with environment.begin(write=True) as txn:
        record_parts.delete(txn, entries, parts, short)
    assert read(env, short) is None and read(env, extended) == data[extended] and read(env, b"a\x00") == b""
