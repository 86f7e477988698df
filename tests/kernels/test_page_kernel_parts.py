"""The CPU kernels' shared parts: float bit patterns read as torch reads them, and the inner loops
(products four rows a pass, sums four tokens and rows a pass, the page's softmax step) equal
their plain definitions at every row count and fill."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.kernels.host_arrays import float_bits
from kvlib.kernels.page_kernel_parts import float_accumulate, float_of, float_scores, padded_rows, softmax_page


@numba.njit
def floats_of(bits: np.ndarray, kind: int, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        out[i] = float_of(bits[i], kind)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_reads_as_its_float(dtype: torch.dtype) -> None:
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    bits, kind = float_bits(values)
    out = np.empty(values.numel(), dtype=np.float32)
    floats_of(bits, kind, out)
    np.testing.assert_array_equal(out, values.float().numpy())  # NaN where NaN, subnormals, infinities


def test_float32_values_read_as_themselves() -> None:
    special = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 3.4e38, float("inf"), float("-inf"), float("nan")])
    values = torch.cat([special, torch.randn(1000) * 1e3])
    bits, kind = float_bits(values)
    out = np.empty(values.numel(), dtype=np.float32)
    floats_of(bits, kind, out)
    np.testing.assert_array_equal(out, values.numpy())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), filled=st.integers(0, 16), dim=st.sampled_from([1, 3, 8, 64]), seed=st.integers(0, 2**16))
def test_the_inner_loops_equal_their_definitions(rows: int, filled: int, dim: int, seed: int) -> None:
    generator = np.random.default_rng(seed)
    query = generator.standard_normal((padded_rows(rows), dim), dtype=np.float32)
    page = generator.standard_normal((16, dim), dtype=np.float32)
    page[filled:] = np.nan  # rows past the fill are never read
    scores = np.full((query.shape[0], 16), 7.0, dtype=np.float32)
    float_scores(query, page, filled, scores)
    np.testing.assert_allclose(scores[:, :filled], query.astype(np.float64) @ page[:filled].T.astype(np.float64), rtol=1e-5, atol=1e-5)
    assert (scores[:, filled:] == 7.0).all()
    weights = generator.random((query.shape[0], 16), dtype=np.float32)
    acc = generator.standard_normal((query.shape[0], dim), dtype=np.float32)
    expected = acc.astype(np.float64) + weights[:, :filled].astype(np.float64) @ page[:filled].astype(np.float64)
    float_accumulate(weights, page, filled, acc)
    np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-5)


@numba.njit
def _softmax_step(scores, rows, queries, filled, seen, scale, softcap, running_max, running_sum, acc, state, weights):
    return softmax_page(
        scores, rows, queries, filled, seen, scale, softcap, running_max, running_sum, acc, state, weights, weights.view(np.int32)
    )


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    queries=st.sampled_from([1, 2]),
    filled=st.integers(1, 8),
    softcap=st.sampled_from([0.0, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_a_page_step_moves_the_running_max_and_rescales_what_it_summed(rows, queries, filled, softcap, seed) -> None:
    generator = np.random.default_rng(seed)
    rows = rows * queries
    padded = padded_rows(rows)
    scores = generator.standard_normal((padded, 8), dtype=np.float32) * 3
    raw = scores.copy()
    seen = generator.random((queries, 8)) < 0.7
    running_max = np.where(generator.random(padded) < 0.5, -np.inf, generator.standard_normal(padded)).astype(np.float32)
    running_sum = np.where(running_max > -np.inf, 2.0, 0.0).astype(np.float32)
    acc = np.ones((padded, 3), dtype=np.float32)
    state = np.ones((padded, 2), dtype=np.float32)
    weights = np.empty(2 * padded * 8, dtype=np.float32)
    before_max, before_sum = running_max.copy(), running_sum.copy()
    any_seen = _softmax_step(
        scores, rows, queries, filled, seen, np.float32(0.5), np.float32(softcap), running_max, running_sum, acc, state, weights
    )
    page = weights[: padded * 8].reshape(padded, 8)
    for r in range(padded):
        s = raw[r, :filled].astype(np.float64) * 0.5
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = np.where(seen[r % queries, :filled] & (r < rows), s, -np.inf)
        page_max = s.max() if s.size else -np.inf
        new_max = max(before_max[r], page_max)
        assert running_max[r] == pytest.approx(new_max, rel=1e-6) if new_max > -np.inf else running_max[r] == -np.inf
        expected = np.exp(s - new_max) if new_max > -np.inf else np.zeros_like(s)
        np.testing.assert_allclose(page[r, :filled], expected, rtol=2e-6, atol=1e-30)
        assert (page[r, filled:] == 0).all()
        rescale = math.exp(before_max[r] - new_max) if before_max[r] > -np.inf and page_max > before_max[r] else 1.0
        assert running_sum[r] == pytest.approx(before_sum[r] * rescale + expected.sum(), rel=1e-5)
        assert acc[r, 0] == pytest.approx(rescale, rel=1e-6) and state[r, 1] == pytest.approx(rescale, rel=1e-6)
    assert any_seen == bool((page[:rows] > 0).any())
