"""GEAR pages: outliers decode to their input, the low-rank part never adds error, the codes match
KIVI's without corrections, the outlier filter narrows ranges, the byte formula and its target;
the fused CPU kernels agree with the torch reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import layer_shapes
from kvlib.policies.quantization import gear_kernels
from kvlib.policies.quantization.gear import GEAR
from kvlib.policies.quantization.gear_codec import narrowing_outliers, power_iteration
from kvlib.policies.quantization.uniform import metadata_dtype
from kvlib.spec_text import parse_policy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def codec(spec: str, page_size: int, dims: tuple[int, int], dtype: torch.dtype):
    return parse_policy(spec).layer_codecs(layer_shapes(1, 2, dims[0], dims[1], page_size, dtype, torch.device("cpu")))[0]


def pages(n: int, page_size: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pages with per-channel offsets and scales, and a few spikes (as real keys have)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, page_size, dim, generator=generator) * (torch.rand(dim, generator=generator) * 3 + 0.1)
    x += torch.randn(dim, generator=generator) * 2
    spikes = torch.rand(x.shape, generator=generator) < 0.01
    return torch.where(spikes, x * 10, x).to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
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
        ({"bits": 5}, "bits"),
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


@settings(max_examples=30, deadline=None)
@given(per_channel=st.booleans(), page_size=st.sampled_from([4, 16]), count=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_the_fused_outlier_filter_takes_what_the_torch_reference_takes(per_channel: bool, page_size: int, count: int, seed: int) -> None:
    gear = codec("gear(rank=0, group=8)", page_size, (32, 32), torch.float32)
    tensor = gear.key if per_channel else gear.value
    x = pages(3, page_size, 32, torch.float32, seed)
    grouped = tensor._grouped(x)
    low, high, chosen = narrowing_outliers(grouped, count)
    clipped = np.empty((3, page_size * 32), dtype=np.float32)
    positions = np.empty((3, count), dtype=np.int64)
    gear_kernels.narrow_outliers(x.numpy(), per_channel, tensor.quantizer.group, count, clipped, positions)
    assert torch.equal(torch.from_numpy(positions), tensor._positions[chosen])
    expected = tensor._paged(torch.maximum(torch.minimum(grouped, high.unsqueeze(-1)), low.unsqueeze(-1)))
    assert torch.equal(torch.from_numpy(clipped).view(3, page_size, 32), expected)


@pytest.mark.parametrize("rank", [1, 2])
def test_the_fused_low_rank_fit_spans_what_the_torch_power_iteration_spans(rank: int) -> None:
    """Both project the residual (outliers zeroed) on the same subspace: ``U V^T`` agree."""
    x = pages(4, 16, 32, torch.float32, 5)
    decoded = torch.zeros(4, 16 * 32)
    chosen = torch.tensor([[0, 33]] * 4)
    tokens, channels = np.empty((4, 16, rank), dtype=np.float32), np.empty((4, 32, rank), dtype=np.float32)
    gear_kernels.fit_low_rank(x.numpy(), decoded.numpy(), chosen.numpy(), 3, tokens, channels)
    residual = x.clone()
    residual.view(4, -1).scatter_(1, chosen, 0.0)
    u, v = power_iteration(residual, rank, 3)
    ours = torch.from_numpy(tokens) @ torch.from_numpy(channels).transpose(1, 2)
    torch.testing.assert_close(ours, u @ v.transpose(1, 2), rtol=1e-4, atol=1e-4 * float(residual.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_decode_equals_the_torch_decode(dtype: torch.dtype) -> None:
    gear = codec("gear(bits=2, rank=2, outliers=0.02, group=8)", 16, (32, 32), dtype)
    x = pages(5, 16, 32, dtype, 3)
    heads = torch.zeros(5, dtype=torch.int64)
    encoded = gear.key.encode(x, heads)
    values = gear.key.quantizer.dequantize(encoded)
    values = values.baddbmm(encoded["token_factors"].float(), encoded["channel_factors"].float().transpose(1, 2))
    values.view(5, -1).scatter_(1, encoded["outlier_index"].long(), encoded["outlier_value"].float())
    torch.testing.assert_close(gear.key.dequantize(encoded), values, rtol=1e-6, atol=1e-6 * float(values.abs().max()))
    out = torch.zeros(7, 16, 32, dtype=dtype)
    gear.key.decode_into(encoded, torch.tensor([4, 0, 2]), heads[:3], out, torch.tensor([6, 1, 2]))
    torch.testing.assert_close(out[[6, 1, 2]], values[[4, 0, 2]].to(dtype), rtol=0, atol=0)
    assert bool((out[[0, 3, 4, 5]] == 0).all())
