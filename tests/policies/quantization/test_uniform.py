"""Quantizers: every element within half a step of its group, bytes held equal the layout's formula."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import TensorShape
from kvlib.policies.quantization.fp8 import PageScaledFP8
from kvlib.policies.quantization.uniform import AbsmaxInt8, GroupQuantizer

CPU = torch.device("cpu")


def shape_of(page_size: int, dim: int, dtype: torch.dtype = torch.float32) -> TensorShape:
    return TensorShape(0, 1, 2, page_size, dim, dtype, CPU)


def pages(seed: int, n: int, page_size: int, dim: int, scale: float, offset: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, page_size, dim, generator=generator) * scale
    channel_offsets = torch.randn(dim, generator=generator) * offset  # outlier channels, as keys have
    return x + channel_offsets


blocks = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "n": st.integers(1, 4),
        "page_size": st.integers(1, 9),
        "dim": st.sampled_from([1, 2, 4, 8, 12, 16, 32]),
        "scale": st.sampled_from([1e-3, 1.0, 30.0]),
        "offset": st.sampled_from([0.0, 5.0, 100.0]),
    }
)


@settings(max_examples=150, deadline=None)
@given(block=blocks, bits=st.sampled_from([2, 3, 4, 8]), per_channel=st.booleans(), group=st.sampled_from([1, 2, 4, 32]))
def test_group_quantization_error_is_at_most_half_a_step(block: dict, bits: int, per_channel: bool, group: int) -> None:
    x = pages(**block)
    dim = block["dim"]
    if not per_channel and dim % min(group, dim):
        return
    codec = GroupQuantizer(shape_of(block["page_size"], dim), bits, per_channel=per_channel, group=group)
    heads = torch.zeros(x.shape[0], dtype=torch.int64)
    encoded = codec.encode(x, heads)
    decoded = codec.decode(encoded, heads)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    step = encoded["scale"].float()
    if per_channel:  # one step per (page, channel), shared by the page's tokens
        step = step.unsqueeze(1).expand(x.shape)
    else:  # one step per (page, token, group of channels)
        step = step.repeat_interleave(codec.group, dim=-1)
    error = (decoded - x).abs()
    assert bool((error <= step / 2 * (1 + 1e-5) + 1e-6 * x.abs()).all()), float((error - step / 2).max())


@settings(max_examples=100, deadline=None)
@given(block=blocks)
def test_int8_error_is_at_most_half_a_step(block: dict) -> None:
    x = pages(**block)
    codec = AbsmaxInt8(shape_of(block["page_size"], block["dim"]))
    heads = torch.zeros(x.shape[0], dtype=torch.int64)
    encoded = codec.encode(x, heads)
    assert encoded["codes"].dtype == torch.int8 and int(encoded["codes"].abs().max()) <= 127
    step = encoded["scale"].float().unsqueeze(-1)
    assert bool(((codec.decode(encoded, heads) - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6 * x.abs()).all())


@settings(max_examples=100, deadline=None)
@given(block=blocks)
def test_fp8_error_is_relative_to_e4m3(block: dict) -> None:
    x = pages(**block)
    codec = PageScaledFP8(shape_of(block["page_size"], block["dim"]))
    heads = torch.zeros(x.shape[0], dtype=torch.int64)
    encoded = codec.encode(x, heads)
    scale = encoded["scale"].view(-1, 1, 1)
    error = (codec.decode(encoded, heads) - x).abs()
    # 3 mantissa bits: half an ulp is 2**-4 of the value in the normal range, 2**-10 * scale below it
    assert bool((error <= 2**-4 * x.abs() + 2**-10 * scale + 1e-6 * x.abs()).all())


def test_constant_groups_are_exact() -> None:
    x = torch.full((2, 4, 8), 3.25)
    for codec in (GroupQuantizer(shape_of(4, 8), 2, per_channel=True), GroupQuantizer(shape_of(4, 8), 2, per_channel=False, group=4)):
        heads = torch.zeros(2, dtype=torch.int64)
        assert torch.equal(codec.decode(codec.encode(x, heads), heads), x)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_group_quantizer_bytes_follow_the_layout(bits: int, dtype: torch.dtype) -> None:
    page_size, dim, group = 16, 128, 32
    keys = GroupQuantizer(shape_of(page_size, dim, dtype), bits, per_channel=True)
    values = GroupQuantizer(shape_of(page_size, dim, dtype), bits, per_channel=False, group=group)
    meta = 2  # fp16 (or bf16) scale and minimum
    code_bytes = math.ceil(page_size * dim * bits / 8)
    assert sum(f.nbytes for f in keys.fields.values()) == code_bytes + 2 * dim * meta
    assert sum(f.nbytes for f in values.fields.values()) == code_bytes + 2 * page_size * (dim // group) * meta
    heads = torch.zeros(3, dtype=torch.int64)
    encoded = values.encode(torch.randn(3, page_size, dim).to(dtype), heads)
    assert sum(t.numel() * t.element_size() for t in encoded.values()) == 3 * sum(f.nbytes for f in values.fields.values())


def test_group_larger_than_the_head_dim_is_clamped() -> None:
    codec = GroupQuantizer(shape_of(16, 8), 4, per_channel=False, group=32)
    assert codec.group == 8 and codec.fields["scale"].shape == (16, 1)


def test_a_group_that_does_not_divide_the_head_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match="valid groups"):
        GroupQuantizer(shape_of(16, 12), 4, per_channel=False, group=8)


@pytest.mark.parametrize("per_channel", [True, False])
def test_values_beyond_the_metadata_range_saturate_instead_of_turning_inf(per_channel: bool) -> None:
    codec = GroupQuantizer(shape_of(4, 8), 4, per_channel=per_channel, group=8)
    x = torch.randn(2, 4, 8)
    x[0, 1, 2] = -7e4  # below fp16's finite range (float32 model, fp16 scales and minima)
    heads = torch.zeros(2, dtype=torch.int64)
    decoded = codec.decode(codec.encode(x, heads), heads)
    assert bool(torch.isfinite(decoded).all())
    assert torch.allclose(decoded[1], x[1], atol=1.0)  # other pages untouched
