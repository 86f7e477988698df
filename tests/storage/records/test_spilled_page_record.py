"""Page records: exact round trips, and every corrupted byte or foreign layout is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.storage.records.spilled_page_record import (
    Block,
    Layout,
    RecordError,
    check_rows,
    decode,
    empty_rows,
    encode,
    row_sections,
)

LAYOUT = Layout(b"n" * 16, layers=2, heads=3, page_size=4, head_dim=5, value_dim=6, dtype=torch.float32)


def block(seed: int = 0, dtype: torch.dtype = torch.float32) -> Block:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, 4, 5, generator=generator).to(dtype)
    values = torch.randn(2, 3, 4, 6, generator=generator).to(dtype)
    return Block(b"k" * 16, b"", [7, 8, 9, 10], keys, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_round_trip_is_exact(dtype: torch.dtype) -> None:
    layout = Layout(LAYOUT.namespace, 2, 3, 4, 5, 6, dtype)
    original = block(dtype=dtype)
    decoded = decode(layout, encode(layout, original))
    assert decoded.key == original.key and decoded.parent == b"" and decoded.tokens == original.tokens
    assert torch.equal(decoded.keys, original.keys) and torch.equal(decoded.values, original.values)


@settings(max_examples=300, deadline=None)
@given(position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_detected(position: float, bit: int) -> None:
    record = bytearray(encode(LAYOUT, block()))
    record[int(position * len(record))] ^= 1 << bit
    with pytest.raises(RecordError):
        decode(LAYOUT, bytes(record))


def test_truncated_foreign_and_misshaped_records_are_refused() -> None:
    record = encode(LAYOUT, block())
    with pytest.raises(RecordError, match="checksum"):
        decode(LAYOUT, bytes(record[:-1]) + b"x")
    with pytest.raises(RecordError):
        decode(LAYOUT, record[:20])
    other_model = Layout(b"m" * 16, 2, 3, 4, 5, 6, torch.float32)
    with pytest.raises(RecordError, match="another model"):
        decode(other_model, record)
    other_dtype = Layout(LAYOUT.namespace, 2, 3, 4, 5, 6, torch.float16)
    with pytest.raises(RecordError, match="shape or dtype"):
        decode(other_dtype, record)


def test_a_record_of_an_earlier_format_is_refused() -> None:
    """Format 3 records carry kvlib's former digest: a reader of format 4 never trusts them."""
    record = bytearray(encode(LAYOUT, block()))
    record[4:6] = (3).to_bytes(2, "little")
    with pytest.raises(RecordError, match="version 4"):
        decode(LAYOUT, bytes(record))


def test_keys_padding_and_half_precision_tails_are_covered() -> None:
    """Keys of 2x1x3x3 fp16 are 36 bytes (padded to 40), values 2x1x3x1 end off an 8-byte word:
    every byte of such a record, padding included, is checked."""
    layout = Layout(b"n" * 16, layers=2, heads=1, page_size=3, head_dim=3, value_dim=1, dtype=torch.float16)
    original = Block(b"k" * 16, b"p" * 16, [1, 2, 3], torch.randn(2, 1, 3, 3).half(), torch.randn(2, 1, 3, 1).half())
    record = encode(layout, original)
    decoded = decode(layout, record)
    assert decoded.parent == b"p" * 16 and torch.equal(decoded.keys, original.keys) and torch.equal(decoded.values, original.values)
    for position in range(len(record)):
        corrupted = bytearray(record)
        corrupted[position] ^= 0x10
        with pytest.raises(RecordError):
            decode(layout, bytes(corrupted))


def test_a_block_of_the_wrong_shape_is_refused_before_encoding() -> None:
    wrong = Block(b"k" * 16, b"", [7, 8, 9, 10], torch.zeros(2, 3, 4, 6), torch.zeros(2, 3, 4, 6))
    with pytest.raises(ValueError, match="keys have shape"):
        encode(LAYOUT, wrong)


ONE_HEAD = Layout(b"r" * 16, layers=1, heads=1, page_size=3, head_dim=3, value_dim=1, dtype=torch.float16)
"""Spilled-page shape with an fp16 tail: keys padded, values ending off an 8-byte word."""


def spilled_rows(count: int) -> tuple[np.ndarray, np.ndarray, list[Block]]:
    """``count`` one-head records copied into :func:`empty_rows`, their chain keys and blocks."""
    blocks = [
        Block(bytes([i]) * 16, b"", [i, i + 1, i + 2], torch.randn(1, 1, 3, 3).half(), torch.randn(1, 1, 3, 1).half()) for i in range(count)
    ]
    rows = empty_rows(ONE_HEAD, count)
    for i, one in enumerate(blocks):
        rows[i] = np.frombuffer(encode(ONE_HEAD, one), dtype=np.uint8)
    chain_keys = np.frombuffer(b"".join(one.key for one in blocks), dtype=np.uint8).reshape(count, 16)
    return rows, chain_keys, blocks


def test_checked_rows_give_back_every_record_exactly() -> None:
    rows, chain_keys, blocks = spilled_rows(5)
    assert check_rows(ONE_HEAD, rows, chain_keys).all()
    keys, values = row_sections(ONE_HEAD, rows)
    for i, one in enumerate(blocks):
        assert torch.equal(torch.from_numpy(keys[i].copy()).view(torch.float16).view(1, 1, 3, 3), one.keys)
        assert torch.equal(torch.from_numpy(values[i].copy()).view(torch.float16).view(1, 1, 3, 1), one.values)


def test_row_checks_fail_exactly_the_corrupted_record_at_every_byte() -> None:
    rows, chain_keys, _ = spilled_rows(3)
    for position in range(rows.shape[1]):
        corrupted = empty_rows(ONE_HEAD, 3)
        corrupted[:] = rows
        corrupted[1, position] ^= 0x10
        assert check_rows(ONE_HEAD, corrupted, chain_keys).tolist() == [True, False, True], position


def test_row_checks_refuse_another_pages_record_and_a_parented_one() -> None:
    rows, chain_keys, _ = spilled_rows(2)
    assert check_rows(ONE_HEAD, rows, chain_keys[::-1].copy()).tolist() == [False, False]
    parented = empty_rows(ONE_HEAD, 1)
    parented[0] = np.frombuffer(
        encode(ONE_HEAD, Block(b"a" * 16, b"p" * 16, [1, 2, 3], torch.zeros(1, 1, 3, 3).half(), torch.zeros(1, 1, 3, 1).half())),
        dtype=np.uint8,
    )
    assert not check_rows(ONE_HEAD, parented, np.frombuffer(b"a" * 16, dtype=np.uint8).reshape(1, 16))[0]
    with pytest.raises(ValueError, match="chain keys"):
        check_rows(ONE_HEAD, rows, chain_keys[:1])
