"""GEAR pages: outliers decode to their input, the low-rank part never adds error, the codes match
KIVI's without corrections, the outlier filter narrows ranges, the byte formula and its target."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import layer_shapes
from kvlib.policies.quantization.gear import GEAR
from kvlib.policies.quantization.gear_codec import narrowing_outliers
from kvlib.policies.quantization.uniform import metadata_dtype
from kvlib.spec_text import parse_strategy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def codec(spec: str, page_size: int, dims: tuple[int, int], dtype: torch.dtype):
    return parse_strategy(spec).layer_codecs(layer_shapes(1, 2, dims[0], dims[1], page_size, dtype, torch.device("cpu")))[0]


def pages(n: int, page_size: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages with per-channel offsets and scales, and a few spikes (as real keys have)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, page_size, dim, generator=generator) * (torch.rand(dim, generator=generator) * 3 + 0.1)
    x += torch.randn(dim, generator=generator) * 2
    spikes = torch.rand(x.shape, generator=generator) < 0.01
    return torch.where(spikes, x * 10, x).to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    rank=st.integers(0, 3),
    outliers=st.sampled_from([0.0, 0.01, 0.1]),
    page_size=st.sampled_from([4, 16]),
    dims=st.sampled_from([(8, 8), (64, 64), (16, 32)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_outliers_are_exact_and_the_low_rank_part_only_removes_error(bits, rank, outliers, page_size, dims, dtype, seed) -> None:
    gear = codec(f"gear(bits={bits}, rank={rank}, outliers={outliers}, group=8)", page_size, dims, dtype)
    plain = codec(f"gear(bits={bits}, rank=0, outliers={outliers}, group=8)", page_size, dims, dtype)
    keys, values = pages(5, page_size, dims[0], dtype, seed), pages(5, page_size, dims[1], dtype, seed + 1)
    heads = torch.zeros(5, dtype=torch.int64)
    encoded = gear.encode(keys, values, heads)
    decoded = gear.decode(encoded, heads)
    assert encoded.keys() == gear.fields.keys()
    for name, tensor in encoded.items():
        assert tensor.shape[1:] == gear.fields[name].shape and tensor.dtype == gear.fields[name].dtype
    for part, x, out, tensor in (("key", keys, decoded[0], gear.key), ("value", values, decoded[1], gear.value)):
        assert out.dtype == dtype and out.shape == x.shape
        if tensor.count:
            index = encoded[f"{part}.outlier_index"].long()
            assert torch.equal(out.view(5, -1).gather(1, index), x.view(5, -1).gather(1, index).to(metadata_dtype(dtype)).to(dtype))
            assert all(row.unique().numel() == tensor.count for row in index)
        # U V^T is the residual's projection on U: the error's Frobenius norm does not grow (up to
        # the factors' and the output's rounding)
        exact = x.float()
        error = (tensor.dequantize({n[len(part) + 1 :]: t for n, t in encoded.items() if n.startswith(part + ".")}) - exact).norm()
        bound = (plain.key if part == "key" else plain.value).dequantize(
            {n[len(part) + 1 :]: t for n, t in plain.encode(keys, values, heads).items() if n.startswith(part + ".")}
        ) - exact
        assert error <= bound.norm() * 1.01 + 1e-2 * exact.abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_corrections_the_codes_are_kivis(dtype: torch.dtype) -> None:
    keys, values = pages(7, 16, 64, dtype, 1), pages(7, 16, 64, dtype, 2)
    heads = torch.zeros(7, dtype=torch.int64)
    gear, kivi = codec("gear(bits=4, rank=0, outliers=0)", 16, (64, 64), dtype), codec("kivi(bits=4)", 16, (64, 64), dtype)
    assert gear.fields == kivi.fields
    ours, theirs = gear.encode(keys, values, heads), kivi.encode(keys, values, heads)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    for a, b in zip(gear.decode(ours, heads), kivi.decode(theirs, heads)):
        assert torch.equal(a, b)


@settings(max_examples=50, deadline=None)
@given(groups=st.integers(1, 6), size=st.integers(2, 9), data=st.data())
def test_narrowing_outliers_leave_each_group_its_remaining_range(groups: int, size: int, data) -> None:
    count = data.draw(st.integers(0, groups * (size - 1)))
    grouped = torch.randn(3, groups, size, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    low, high, chosen = narrowing_outliers(grouped, count)
    for page in range(3):
        taken = torch.zeros(groups * size, dtype=torch.bool)
        taken[chosen[page]] = True
        assert int(taken.sum()) == count  # distinct
        kept = ~taken.view(groups, size)
        assert bool(kept.any(-1).all())  # every group keeps an entry
        for g in range(groups):
            rest = grouped[page, g][kept[g]]
            assert low[page, g] == rest.min() and high[page, g] == rest.max()


def test_the_first_outlier_is_the_spike_that_narrows_its_group_most() -> None:
    grouped = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [0.0, 0.1, 0.2, 9.0]]])
    low, high, chosen = narrowing_outliers(grouped, 1)
    assert chosen.tolist() == [[7]] and high[0, 1] == pytest.approx(0.2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_page_bytes_follow_the_formula_and_the_default_stays_within_a_quarter_over_kivi(dtype: torch.dtype) -> None:
    """SmolLM2's layout: 16-token pages, head_dim 64 for keys and values."""
    kivi = codec("kivi(bits=4)", 16, (64, 64), dtype).page_bytes()
    for rank, outliers in ((1, 0.003), (4, 0.01), (0, 0.0)):
        count = math.ceil(outliers * 16 * 64)
        gear = codec(f"gear(rank={rank}, outliers={outliers})", 16, (64, 64), dtype).page_bytes()
        assert gear == kivi + 2 * (rank * (16 + 64) * 2 + count * (2 + 2))
    assert codec("gear", 16, (64, 64), dtype).page_bytes() <= 1.25 * kivi


def test_outliers_are_capped_at_what_the_groups_can_give_up() -> None:
    gear = codec("gear(outliers=0.4, rank=0)", 1, (8, 8), torch.float32)  # per-channel key groups of one token
    assert gear.key.count == 0 and "outlier_index" not in gear.key.fields and gear.value.count == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, "bits"),
        ({"rank": -1}, "rank"),
        ({"outliers": 0.5}, "outliers"),
        ({"outliers": -0.1}, "outliers"),
        ({"outliers": "many"}, "outliers"),
        ({"iterations": 0}, "iterations"),
        ({"group": 0}, "group"),
    ],
)
def test_invalid_parameters_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GEAR(**kwargs)


def test_a_rank_beyond_the_page_is_refused_before_model_work() -> None:
    with pytest.raises(ValueError, match="rank=5"):
        GEAR(rank=5).check_shape(layer_shapes(1, 1, 64, 64, 4, torch.float32, torch.device("cpu")))
