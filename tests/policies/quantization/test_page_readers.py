"""The quantization codecs' numba page readers (scales folded into the query or the weights, the
rotation into the query) equal dequantize-then-attend: a sealed page's scores against query rows
are ``query @ decoded keys``, its weighted values ``weights @ decoded values``, the decode being
the codec's own float32 one, for every codec, bit width, layout and compute dtype, any number of
query rows (padded to fours) and any fill of the page."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.kernels.page_kernel_parts import padded_rows
from kvlib.kernels.page_readers import numba_reader
from tests.policies.quantization.test_page_loaders import coded_store

READER_CODECS = [
    "kivi(bits=2)",
    "kivi(bits=4)",
    "kivi(bits=4, group=4)",
    "kivi(bits=8, group=8)",
    "kivi(bits=3, group=4)",
    "kv_bits(key_bits=4, value_bits=2, group=16)",
    "int8",
    "fp8",
    "rotated(bits=4)",
    "rotated(bits=2)",
    "rotated(bits=2, group=8)",
    "rotated(bits=3, key_bits=8)",
    "gear(bits=2, rank=2, outliers=0.05, group=4)",
    "mixed(high_bits=4, low_bits=2, salient=0.5, group=4)",
    "qaq",
    "qaq(key_bits=2.5, value_bits=1.5, min_bits=1, max_bits=8, outliers=0.2)",
    "qaq(outliers=0, min_bits=2, max_bits=3)",
]
"""Every reader and layout: per-channel keys folded into the query (kivi, kv_bits, rotated at
equal bits), per-token keys in one group (rotated's 4-bit keys over 2-bit values) and in several
(rotated with ``group=8``), one-byte codes (int8 per token, fp8 per page), and the codecs read
through a page loader (gear, mixed, qaq: tokens at their own bits among 1, 2, 3, 4 and 8, with
and without outliers)."""

TOLERANCE = 2e-5
"""float32 rounding of sums taken in another order (relative to the products' magnitudes)."""


def sealed_pool(spec: str, dtype: torch.dtype, dim: int, seed: int):
    """A one-layer pool of two KV heads whose full pages are sealed by ``spec``'s codec, with
    channels of their own offsets and scales (as keys' outlier channels)."""
    store = coded_store(spec, 2, (dim, dim), 16, dtype)
    generator = torch.Generator().manual_seed(seed)
    seq = store.new_sequence()
    scale = torch.rand(dim, generator=generator) * 4 + 0.1
    offset = torch.randn(dim, generator=generator) * 3
    tokens = lambda: (torch.randn(1, 2, 40, dim, generator=generator) * scale + offset).to(dtype)  # noqa: E731
    store.append(0, [seq], tokens(), tokens())
    store.seal(0, [seq])
    pool = store.pools[0]
    assert pool.format.kernel_readers is not None or pool.page_source() is not None
    return pool


def decoded(pool, part: str) -> torch.Tensor:
    """float32 ``[capacity, page_size, dim]``: the codec's own float32 decode of every sealed page."""
    codec = getattr(pool.codec, part)
    prefix = f"{part}."
    arenas = {name[len(prefix) :]: arena for name, arena in pool.encoded.items() if name.startswith(prefix)}
    out = torch.zeros(pool.capacity, pool.page_size, pool.head_dim)
    sealed = pool.sealed.nonzero().squeeze(-1)
    codec.decode_into(arenas, sealed, pool.page_heads[sealed], out, sealed)
    return out


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from(READER_CODECS),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    dim=st.sampled_from([8, 32, 64]),
    rows=st.integers(1, 9),
    filled=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_a_sealed_page_reads_as_its_float32_decode(spec, dtype, dim, rows, filled, seed) -> None:
    assert_pages_read_as_decoded(sealed_pool(spec, dtype, dim, seed), dim, rows, filled, seed)


def assert_pages_read_as_decoded(pool, dim: int, rows: int, filled: int, seed: int) -> None:
    """Every sealed page of ``pool``, read by its codec's numba readers for its own KV head, scores
    ``rows`` random query rows and sums ``filled`` tokens' values as ``query @ decoded keys`` and
    ``weights @ decoded values`` do (``decoded``: the codec's float32 decode), within :data:`TOLERANCE`."""
    keys, values = pool.format.kernel_readers
    key_reader, value_reader = numba_reader(keys.kernel), numba_reader(values.kernel)
    key_fields, value_fields = key_reader.fields(keys.fields, keys.params), value_reader.fields(values.fields, values.params)
    generator = np.random.default_rng(seed)
    padded = padded_rows(rows)
    query = np.zeros((padded, dim), dtype=np.float32)
    query[:rows] = generator.standard_normal((rows, dim), dtype=np.float32)
    weights = np.zeros((2 * padded, 16), dtype=np.float32)  # the kernel's: weights, then exp's scratch
    weights[:rows, :filled] = generator.random((rows, filled), dtype=np.float32)
    decoded_keys, decoded_values = decoded(pool, "key").double().numpy(), decoded(pool, "value").double().numpy()
    for page in pool.sealed.nonzero().squeeze(-1).tolist():
        head = int(pool.page_heads[page])
        scores = np.full((padded, 16), np.nan, dtype=np.float32)
        work = key_reader.prepare_keys(key_fields, query, head)
        key_reader.key_scores(key_fields, page, head, query, work, filled, scores, np.empty((16, dim), dtype=np.float32))
        expected = query[:rows].astype(np.float64) @ decoded_keys[page, :filled].T
        bound = TOLERANCE * (np.abs(query[:rows]).astype(np.float64) @ np.abs(decoded_keys[page, :filled]).T + 1)
        assert (np.abs(scores[:rows, :filled] - expected) <= bound).all(), (page, scores[:rows, :filled], expected)
        acc = np.zeros((padded, dim), dtype=np.float32)
        state = value_reader.prepare_values(value_fields, padded, dim)
        value_reader.accumulate_values(value_fields, page, head, weights, filled, acc, state, np.empty((16, dim), dtype=np.float32))
        value_reader.finish_values(value_fields, acc, state, head)
        expected = weights[:rows, :filled].astype(np.float64) @ decoded_values[page, :filled]
        bound = TOLERANCE * (weights[:rows, :filled].astype(np.float64) @ np.abs(decoded_values[page, :filled]) + 1)
        assert (np.abs(acc[:rows] - expected) <= bound).all(), (page, acc[:rows], expected)


@pytest.mark.parametrize("spec", ["rotated(bits=4)", "rotated(bits=2)"])
def test_a_rotated_page_read_for_another_head_is_rotated_back_with_its_own_signs(spec: str) -> None:
    """The rotation is folded into the query of the head read; a page stored for another head (never,
    as the store lays pages out) is still read as its own decode."""
    pool = sealed_pool(spec, torch.float32, 32, 5)
    keys, values = pool.format.kernel_readers
    key_reader, value_reader = numba_reader(keys.kernel), numba_reader(values.kernel)
    key_fields, value_fields = key_reader.fields(keys.fields, keys.params), value_reader.fields(values.fields, values.params)
    page = int(pool.sealed.nonzero()[0])
    other = 1 - int(pool.page_heads[page])
    query = np.random.default_rng(0).standard_normal((4, 32), dtype=np.float32)
    scores = np.empty((4, 16), dtype=np.float32)
    key_reader.key_scores(
        key_fields, page, other, query, key_reader.prepare_keys(key_fields, query, other), 16, scores, np.empty((16, 32), np.float32)
    )
    np.testing.assert_allclose(scores, query.astype(np.float64) @ decoded(pool, "key").double().numpy()[page].T, rtol=1e-4, atol=1e-4)
    weights = np.ones((8, 16), dtype=np.float32)
    acc = np.zeros((4, 32), dtype=np.float32)
    state = value_reader.prepare_values(value_fields, 4, 32)
    value_reader.accumulate_values(value_fields, page, other, weights, 16, acc, state, np.empty((16, 32), np.float32))
    value_reader.finish_values(value_fields, acc, state, other)
    np.testing.assert_allclose(acc[0], decoded(pool, "value").double().numpy()[page].sum(0), rtol=1e-4, atol=1e-4)


def test_an_unregistered_reader_is_named_with_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="registered: .*'group'"):
        numba_reader("no such reader")
