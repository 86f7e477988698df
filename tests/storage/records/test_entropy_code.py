"""The entropy coder: exact round trips of any uint8 arrays (hypothesis), and damaged streams are
an EntropyCodeError, never a crash, a wrong array or a write outside the output."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlib.storage.records import entropy_code
from kvlib.storage.records.entropy_code import EntropyCodeError, decode, encode, normalized_frequencies

byte_arrays = arrays(np.uint8, st.integers(0, 3000))


def skewed(draw_seed: int, size: int, alphabet: int, power: float) -> np.ndarray:
    """``size`` bytes over the first ``alphabet`` symbols, Zipf-like with exponent ``power``."""
    rng = np.random.default_rng(draw_seed)
    weights = 1.0 / np.arange(1, alphabet + 1) ** power
    return rng.choice(alphabet, size=size, p=weights / weights.sum()).astype(np.uint8)


@settings(max_examples=200, deadline=None)
@given(st.lists(byte_arrays, max_size=5))
def test_round_trip_of_arbitrary_arrays(data: list[np.ndarray]) -> None:
    out = decode(encode(data))
    assert len(out) == len(data) and all(np.array_equal(a, b) for a, b in zip(out, data))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 20000), st.integers(2, 256), st.floats(0.0, 4.0))
def test_round_trip_of_skewed_distributions(seed: int, size: int, alphabet: int, power: float) -> None:
    data = skewed(seed, size, alphabet, power)
    assert np.array_equal(decode(encode([data]))[0], data)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros(0, np.uint8),
        np.full(1, 9, np.uint8),
        np.full(5000, 255, np.uint8),
        np.arange(256, dtype=np.uint8),
        np.tile(np.arange(256, dtype=np.uint8), 40),
        np.concatenate([np.zeros(100000, np.uint8), np.arange(256, dtype=np.uint8)]),  # 255 symbols of frequency 1
        np.array([0, 255] * 3 + [0], np.uint8),
    ],
    ids=["empty", "one", "single-symbol", "all-256-once", "all-256-uniform", "one-dominant", "two-symbols-odd"],
)
def test_round_trip_of_edge_cases(data: np.ndarray) -> None:
    assert np.array_equal(decode(encode([data]))[0], data)


def test_skewed_data_is_coded_near_its_entropy_and_uniform_data_stays_raw() -> None:
    data = skewed(0, 100000, 16, 1.5)
    counts = np.bincount(data, minlength=256)
    p = counts[counts > 0] / data.size
    entropy_bytes = -(p * np.log2(p)).sum() * data.size / 8
    assert len(encode([data])) < entropy_bytes * 1.01 + 600
    uniform = np.random.default_rng(0).integers(0, 256, 10000).astype(np.uint8)
    assert len(encode([uniform])) <= uniform.size + 16


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=256, max_size=256))
def test_frequencies_sum_to_the_total_and_keep_every_symbol(counts: list[int]) -> None:
    counts = np.array(counts, dtype=np.int64)
    if counts.sum() == 0:
        return
    freq = normalized_frequencies(counts)
    assert freq.sum() == 1 << entropy_code.PROB_BITS
    assert np.all((freq > 0) == (counts > 0))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.data())
def test_damaged_streams_fail_cleanly(seed: int, data: st.DataObject) -> None:
    """Flipped bytes, cut or extended streams: the original arrays or an EntropyCodeError, and
    nothing larger than the limit is ever allocated."""
    original = [skewed(seed, 3000, 40, 1.2), skewed(seed + 1, 500, 256, 0.3)]
    stream = bytearray(encode(original))
    kind = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    if kind == "flip":
        for at in data.draw(st.lists(st.integers(0, len(stream) - 1), min_size=1, max_size=4)):
            stream[at] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        del stream[data.draw(st.integers(0, len(stream) - 1)) :]
    else:
        stream += bytes(data.draw(st.binary(min_size=1, max_size=8)))
    try:
        out = decode(bytes(stream), max_bytes=3500)
    except EntropyCodeError:
        return
    assert sum(a.size for a in out) <= 3500  # a flip that decodes is one the coder cannot see (in raw or table bytes)


def test_lengths_beyond_the_limit_are_refused_before_allocating() -> None:
    stream = bytearray(encode([np.full(10, 3, np.uint8)]))
    stream[5:9] = (2**32 - 1).to_bytes(4, "little")  # the repeated array claims 4 GiB
    with pytest.raises(EntropyCodeError, match="byte limit"):
        decode(bytes(stream))


def test_non_byte_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        encode([np.zeros(3, np.float32)])
