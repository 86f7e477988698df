"""The fused numba kernels give what the torch reference gives (codes, scales, decoded values),
and decode_into writes only the rows it names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import TensorShape
from kvlib.policies.quantization.fp8 import PageScaledFP8
from kvlib.policies.quantization.uniform import AbsmaxInt8, GroupQuantizer, round_up


def codec_pair(page_size: int, dim: int, bits: int, per_channel: bool, group: int, dtype: torch.dtype):
    shape = TensorShape(0, 1, 2, page_size, dim, dtype, torch.device("cpu"))
    fused = GroupQuantizer(shape, bits, per_channel=per_channel, group=group)
    reference = GroupQuantizer(shape, bits, per_channel=per_channel, group=group)
    reference._kernels = False
    return fused, reference


@settings(max_examples=80, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    per_channel=st.booleans(),
    page_size=st.sampled_from([4, 8, 16]),
    dim=st.sampled_from([8, 32, 64]),
    group=st.sampled_from([8, 32]),
    n=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_kernels_match_the_torch_reference(bits, per_channel, page_size, dim, group, n, seed, dtype) -> None:
    fused, reference = codec_pair(page_size, dim, bits, per_channel, group, dtype)
    assert fused._kernels
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, page_size, dim, generator=generator) * 3 + torch.randn(dim, generator=generator) * 10).to(dtype)
    heads = torch.zeros(n, dtype=torch.int64)
    a, b = fused.encode(x, heads), reference.encode(x, heads)
    assert torch.equal(a["scale"], b["scale"]) and torch.equal(a["minimum"], b["minimum"])
    assert torch.equal(a["codes"], b["codes"])
    decoded, expected = fused.decode(a, heads), reference.decode(b, heads)
    assert decoded.dtype == dtype
    assert torch.allclose(decoded.float(), expected.float(), rtol=1e-6, atol=1e-6 * float(x.float().abs().max()))


def test_decode_into_writes_only_the_named_rows() -> None:
    fused, _ = codec_pair(16, 32, 4, True, 32, torch.float32)
    x = torch.randn(6, 16, 32)
    heads = torch.zeros(6, dtype=torch.int64)
    arenas = fused.encode(x, heads)
    out = torch.full((4, 16, 32), 7.0)
    fused.decode_into(arenas, torch.tensor([5, 1]), heads[:2], out, torch.tensor([2, 0]))
    full = fused.decode(arenas, heads)
    assert torch.equal(out[2], full[5]) and torch.equal(out[0], full[1])
    assert bool((out[1] == 7).all()) and bool((out[3] == 7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("codec_class", [AbsmaxInt8, PageScaledFP8])
def test_table_kernels_match_the_torch_decode(codec_class, dtype: torch.dtype) -> None:
    codec = codec_class(TensorShape(0, 1, 2, 16, 32, dtype, torch.device("cpu")))
    x = (torch.randn(5, 16, 32, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    heads = torch.zeros(5, dtype=torch.int64)
    arenas = codec.encode(x, heads)
    arenas = {name: t.clone() for name, t in arenas.items()}
    expected = codec.decode(arenas, heads)
    out = torch.full((7, 16, 32), 9.0, dtype=dtype)
    rows = torch.tensor([6, 0, 1, 2, 4])  # runs and gaps, as a read's rows have
    codec.decode_into(arenas, torch.tensor([4, 0, 1, 2, 3]), heads, out, rows)
    assert torch.allclose(out[rows].float(), expected[[4, 0, 1, 2, 3]].float(), rtol=1e-6, atol=0)
    assert bool((out[[3, 5]] == 9).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int8_kernel_encode_matches_the_torch_reference(dtype: torch.dtype) -> None:
    codec = AbsmaxInt8(TensorShape(0, 1, 2, 16, 32, dtype, torch.device("cpu")))
    x = (torch.randn(5, 16, 32, generator=torch.Generator().manual_seed(4)) * 7).to(dtype)
    x[1, 3] = 0  # an all-zero token
    heads = torch.zeros(5, dtype=torch.int64)
    fused = codec.encode(x, heads)
    step = fused["scale"].float().unsqueeze(-1)
    expected = (x.float() * torch.where(step > 0, 1.0 / step, 0.0)).round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(fused["codes"], expected)
    assert torch.equal(fused["scale"], round_up(x.float().abs().amax(-1) / 127, fused["scale"].dtype))
