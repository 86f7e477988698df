"""The record digest (XXH3-64): deterministic, the digest of buffers held apart is that of their
concatenation, and corruption is caught: every flipped byte, any change within one 8-byte word,
every pair of flipped bits across two words of XXH3's lanes, stripes and blocks."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.storage.records.record_digest import digest, rows_digests

SIZE = 333
"""A record-like length: not a whole number of 8-byte words, of XXH3's 64-byte stripes or of
its 1,024-byte blocks (its long-input path: over 240 bytes)."""


def data(seed: int = 0, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_the_digest_is_xxh3_64_of_the_bytes() -> None:
    original = data()
    assert digest(original) == xxhash.xxh3_64_intdigest(original.tobytes()) == digest(original.copy())


def test_every_flipped_byte_at_every_position_changes_the_digest() -> None:
    original = data()
    reference = digest(original)
    for position in range(SIZE):
        for flip in (0x01, 0x80, 0xFF):
            corrupted = original.copy()
            corrupted[position] ^= flip
            assert digest(corrupted) != reference, (position, flip)


@settings(max_examples=300, deadline=None)
@given(word=st.integers(0, SIZE // 8 - 1), mask=st.integers(1, 2**64 - 1))
def test_any_change_within_one_word_changes_the_digest(word: int, mask: int) -> None:
    original = data(1)
    corrupted = original.copy()
    corrupted[8 * word : 8 * word + 8] ^= np.frombuffer(mask.to_bytes(8, "little"), dtype=np.uint8)
    assert digest(corrupted) != digest(original)


def test_buffers_held_apart_digest_as_their_concatenation_and_reordering_them_changes_it() -> None:
    original = data(2)
    cuts = (0, 80, 208, 304, SIZE)
    sections = [original[a:b] for a, b in zip(cuts, cuts[1:])]
    assert digest(*sections) == digest(original) == digest(original[:81], original[81:])
    assert digest(sections[0], sections[2], sections[1], sections[3]) != digest(original)
    shifted = np.empty(SIZE + 3, dtype=np.uint8)[3:]  # any alignment
    shifted[:] = original
    assert digest(shifted) == digest(original) == digest(memoryview(original.tobytes()), b"")


WIDE = 3 * 1024 + 8 * 13 + 5
"""Three XXH3 blocks (a scramble after each), loose stripes, a tail: the last stripe overlaps the one before."""


def test_every_byte_of_a_multi_block_record_changes_the_digest() -> None:
    original = data(4, WIDE)
    reference = digest(original)
    for position in range(WIDE):
        corrupted = original.copy()
        corrupted[position] ^= 0x01 << position % 8
        assert digest(corrupted) != reference, position
    swapped = original.copy()  # two words of one lane, one stripe apart, exchanged
    swapped[80:88], swapped[144:152] = original[144:152], original[80:88]
    assert digest(swapped) != reference


@pytest.mark.parametrize("pair", [(2, 3), (3, 4), (0, 1), (3, 11), (3, 131), (127, 128), (67, 195), (388, 389)], ids=str)
def test_no_two_flipped_bits_in_two_words_cancel(pair: tuple[int, int]) -> None:
    """Every pair of flipped bits in two words changes the digest: the two words of a lane pair
    (XXH3 adds each word to its neighbour lane and multiplies its halves into its own), neighbours,
    one lane a stripe apart, across a block's scramble, and in the last stripe (read twice)."""
    words = 390
    original = data(6, 8 * words).view(np.uint64)
    reference = digest(original)
    for first in range(64):
        for second in range(64):
            corrupted = original.copy()
            corrupted[pair[0]] ^= np.uint64(1 << first)
            corrupted[pair[1]] ^= np.uint64(1 << second)
            assert digest(corrupted) != reference, (first, second)


def test_rows_digests_digest_each_row_and_refuse_other_arrays() -> None:
    rows = np.empty((5, 40), dtype=np.uint8)[:, : SIZE % 40]  # rows spaced apart, as empty_rows lays them out
    rows[:] = data(7, rows.size).reshape(rows.shape)
    assert rows_digests(rows).tolist() == [digest(row.copy()) for row in rows]
    assert rows_digests(rows[:0]).shape == (0,)
    with pytest.raises(ValueError, match="uint8"):
        rows_digests(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        rows_digests(rows[:, ::2])
