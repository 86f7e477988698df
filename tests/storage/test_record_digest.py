"""The record digest: deterministic, and any corruption confined to one 8-byte word changes it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.storage.record_digest import record_digest, sections_digest

CUTS = (0, 80, 208, 304, 333)
"""A record-like layout: an 80-byte header, three sections, the last with a 5-byte tail."""


def data(seed: int = 0, size: int = 333) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_every_flipped_byte_at_every_position_changes_the_digest() -> None:
    original = data()
    reference = record_digest(original, CUTS)
    for position in range(CUTS[-1]):
        for flip in (0x01, 0x80, 0xFF):
            corrupted = original.copy()
            corrupted[position] ^= flip
            assert record_digest(corrupted, CUTS) != reference, (position, flip)


@settings(max_examples=300, deadline=None)
@given(word=st.integers(0, CUTS[-1] // 8 - 1), mask=st.integers(1, 2**64 - 1))
def test_any_change_within_one_word_changes_the_digest(word: int, mask: int) -> None:
    original = data(1)
    corrupted = original.copy()
    corrupted[8 * word : 8 * word + 8] ^= np.frombuffer(mask.to_bytes(8, "little"), dtype=np.uint8)
    assert record_digest(corrupted, CUTS) != record_digest(original, CUTS)


def test_moving_bytes_between_sections_or_reordering_sections_changes_the_digest() -> None:
    original = data(2)
    assert record_digest(original, CUTS) == record_digest(original.copy(), CUTS)
    assert record_digest(original, CUTS) != record_digest(original, (0, 80, 216, 304, 333))
    swapped = np.concatenate([original[:80], original[208:304], original[80:208], original[304:333]])
    assert record_digest(swapped, (0, 80, 176, 304, 333)) != record_digest(original, CUTS)


def test_unaligned_sources_give_the_same_digest() -> None:
    original = data(3)
    shifted = np.empty(CUTS[-1] + 3, dtype=np.uint8)[3:]
    shifted[:] = original
    assert record_digest(shifted, CUTS) == record_digest(original, CUTS)


def test_bad_cuts_and_sources_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        record_digest(data(), (0, 81, 333))
    with pytest.raises(ValueError, match="past the source"):
        record_digest(data(size=100), (0, 80, 333))
    with pytest.raises(ValueError, match="uint8"):
        record_digest(np.zeros(4, dtype=np.int64), (0, 8))


WIDE = (0, 80, 80 + 8 * (3 * 64 + 5), 80 + 8 * (3 * 64 + 5) + 8 * 64 + 3)
"""Sections of several 64-word stripes plus loose words (the vectorised lanes), then a tail."""


def test_every_word_of_multi_stripe_sections_changes_the_digest() -> None:
    original = data(4, WIDE[-1])
    reference = record_digest(original, WIDE)
    for word in range(WIDE[-1] // 8):
        for flip in (0x01, 0x80):
            corrupted = original.copy()
            corrupted[8 * word + word % 8] ^= flip
            assert record_digest(corrupted, WIDE) != reference, word
    swapped = original.copy()  # two words of one lane exchanged
    swapped[80:88], swapped[80 + 8 * 64 : 88 + 8 * 64] = original[80 + 8 * 64 : 88 + 8 * 64], original[80:88]
    assert record_digest(swapped, WIDE) != reference


@pytest.mark.parametrize("pair", [(3, 67), (3, 131), (67, 131), (67, 195), (3, 4), (0, 1), (388, 389)], ids=str)
def test_no_two_flipped_bits_in_two_words_cancel(pair: tuple[int, int]) -> None:
    """Words of one lane within a stripe and across stripes, neighbours in lanes and past the last
    stripe: every pair of flipped bits changes the digest (a multiply passes a top-bit change
    through unchanged; no word's top bits may meet the next word's there)."""
    cuts = (0, 8 * 390)
    original = data(6, cuts[-1]).view(np.uint64)
    reference = record_digest(original.view(np.uint8), cuts)
    for first in range(64):
        for second in range(64):
            corrupted = original.copy()
            corrupted[pair[0]] ^= np.uint64(1 << first)
            corrupted[pair[1]] ^= np.uint64(1 << second)
            assert record_digest(corrupted.view(np.uint8), cuts) != reference, (first, second)


def test_sections_held_apart_digest_as_their_concatenation() -> None:
    original = data(5, WIDE[-1])
    sections = [original[a:b].copy() for a, b in zip(WIDE, WIDE[1:])]
    assert sections_digest(sections) == record_digest(original, WIDE)
    unaligned = np.empty(WIDE[2] + 1, dtype=np.uint8)[1:]
    unaligned[:] = original[: WIDE[2]]
    assert sections_digest([unaligned[:80], unaligned[80:], sections[2]]) == record_digest(original, WIDE)
    with pytest.raises(ValueError, match="multiple of 8"):
        sections_digest([original[:12], original[12:20]])
