"""Rotated codec: the Hadamard rotation is orthogonal and undone on read, each token row's error
is within the group quantizer's half steps (rotated back), signs are fixed per (layer, head) by
the seed, bytes held follow the layout, and bad parameters fail before any model work."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import layer_shapes
from kvlib.kernels.packing import packed_size
from kvlib.policies.quantization.hadamard import RotatedQuantizer, hadamard, random_signs
from kvlib.policies.quantization.rotated import Rotated
from kvlib.spec_text import parse_policy
from tests.policies.quantization.test_page_loaders import coded_store

CPU = torch.device("cpu")


def sylvester(d: int) -> torch.Tensor:
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < d:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix / d**0.5


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_hadamard_is_sylvesters_matrix_and_its_own_inverse(d: int) -> None:
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(hadamard(x), x @ sylvester(d), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard(hadamard(x)), x, atol=1e-5, rtol=1e-5)


def codec(bits: int, heads: int, page_size: int, dim: int, dtype: torch.dtype, seed: int = 0, layer: int = 0):
    shapes = layer_shapes(layer + 1, heads, dim, dim, page_size, dtype, CPU)
    return Rotated(bits=bits, group=8, seed=seed).layer_codecs(shapes)[layer]


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    heads=st.integers(1, 3),
    page_size=st.sampled_from([1, 4, 16]),
    dim=st.sampled_from([2, 8, 32]),
    outlier=st.sampled_from([0.0, 20.0]),
    seed=st.integers(0, 2**16),
)
def test_each_token_row_is_within_its_groups_half_steps(bits, heads, page_size, dim, outlier, seed) -> None:
    """Rotated back, a row's error has the L2 norm of its rotated error, whose elements are each
    within half their group's step (float32: no rounding to a compute dtype)."""
    generator = torch.Generator().manual_seed(seed)
    pages = 2 * heads
    block = torch.randn(pages, page_size, dim, generator=generator)
    block[..., 0] += outlier  # an outlier channel, as keys have
    page_heads = torch.arange(pages) % heads
    page_codec = codec(bits, heads, page_size, dim, torch.float32, seed)
    for part, tensor_codec in (("key", page_codec.key), ("value", page_codec.value)):
        encoded = tensor_codec.encode(block, page_heads)
        error = (tensor_codec.decode(encoded, page_heads) - block).norm(dim=-1)
        half = encoded["scale"].float() / 2
        if tensor_codec.inner.per_channel:  # [pages, dim]: every row has each channel's step
            bound = half.norm(dim=-1, keepdim=True).expand(pages, page_size)
        else:  # [pages, tokens, groups] of `group` channels each
            bound = (half.square() * tensor_codec.inner.group).sum(-1).sqrt()
        assert bool((error <= bound * 1.001 + 1e-4).all()), part


def test_decode_into_equals_decode_and_uses_each_pages_head() -> None:
    page_codec = codec(2, 3, 16, 32, torch.float32)
    block = torch.randn(6, 16, 32, generator=torch.Generator().manual_seed(1))
    heads = torch.tensor([0, 1, 2, 2, 1, 0])
    encoded = page_codec.key.encode(block, heads)
    decoded = page_codec.key.decode(encoded, heads)
    out = torch.zeros(8, 16, 32)
    rows = torch.tensor([7, 0, 1, 2, 5, 6])
    page_codec.key.decode_into(encoded, torch.arange(6), heads, out, rows)
    torch.testing.assert_close(out[rows], decoded)
    assert torch.equal(encoded["head"].view(-1), heads.to(torch.uint8))
    wrong = page_codec.key.decode(encoded, (heads + 1) % 3)
    assert float((wrong - block).norm()) > 2 * float((decoded - block).norm())


def test_signs_are_fixed_by_seed_layer_part_and_head() -> None:
    shapes = layer_shapes(2, 4, 64, 64, 16, torch.float32, CPU)
    key = random_signs(7, shapes[1][0], 0)
    assert key.dtype == torch.int8 and set(key.unique().tolist()) == {-1, 1}
    assert torch.equal(key, random_signs(7, shapes[1][0], 0))
    assert not torch.equal(key, random_signs(8, shapes[1][0], 0))
    assert not torch.equal(key, random_signs(7, shapes[0][0], 0))
    assert not torch.equal(key, random_signs(7, shapes[1][0], 1))
    assert len({tuple(row.tolist()) for row in key}) == 4  # one vector per head


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bytes_formula(bits: int, dtype: torch.dtype) -> None:
    """Keys at ``max(bits, 4)`` bits, per token in groups of 8 channels below 4 bits, else per
    channel; values per token in groups of 8: codes + fp16/bf16 scale and minimum per group + a
    head byte. State: an int8 sign per channel and head."""
    page_size, dim, heads = 16, 64, 3
    page_codec = codec(bits, heads, page_size, dim, dtype)
    key_bits = max(bits, 4)
    key_codes, value_codes = packed_size(page_size * dim, key_bits), packed_size(page_size * dim, bits)
    token_groups = 2 * 2 * page_size * dim // 8
    key_groups = token_groups if key_bits > bits else 2 * 2 * dim
    assert page_codec.page_bytes() == key_codes + value_codes + key_groups + token_groups + 2
    assert page_codec.page_bytes(metadata=False) == key_codes + value_codes
    assert page_codec.state_bytes() == 2 * heads * dim
    assert isinstance(page_codec.key, RotatedQuantizer) and page_codec.key.inner.bits == key_bits
    assert page_codec.key.inner.per_channel == (key_bits == bits) and page_codec.value.inner.bits == bits


def nbytes(tensor_codec) -> int:
    """Bytes of one page of a tensor codec's fields."""
    return sum(field.nbytes for field in tensor_codec.fields.values())


def test_per_channel_keys_take_kivis_key_layout() -> None:
    shapes = layer_shapes(1, 2, 64, 64, 16, torch.float32, CPU)
    page_codec = Rotated(bits=2, keys="channel").layer_codecs(shapes)[0]
    assert page_codec.key.inner.per_channel and page_codec.key.inner.bits == 4
    assert nbytes(page_codec.key) == packed_size(16 * 64, 4) + 2 * 2 * 64 + 1
    token_keys = Rotated(bits=4, keys="token").layer_codecs(shapes)[0].key.inner
    assert not token_keys.per_channel and token_keys.group == 64


def test_two_bits_store_what_kivi_stores_plus_head_bytes_at_smollm2s_layout() -> None:
    """16-token pages, head dim 64: 4-bit keys per token in groups of 64 (4.5 bits an element)
    and 2-bit values in groups of 64 (2.5) take the 7 bits KIVI's 2-bit keys (2 + 2 of per-channel
    scales and minima) and values in groups of 32 (2 + 1) take."""
    shapes = layer_shapes(1, 3, 64, 64, 16, torch.float32, CPU)
    rotated, kivi = Rotated(bits=2).layer_codecs(shapes)[0], parse_policy("kivi(bits=2)").layer_codecs(shapes)[0]
    assert nbytes(rotated.key) == nbytes(kivi.key) + 64 + 1
    assert rotated.page_bytes() == kivi.page_bytes() + 2


def test_bad_parameters_and_shapes_fail_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        parse_policy("rotated(bits=5)")
    with pytest.raises(ValueError, match="key_bits must be one of"):
        parse_policy("rotated(key_bits=5)")
    with pytest.raises(ValueError, match="keys must be one of"):
        parse_policy('rotated(keys="diagonal")')
    with pytest.raises(ValueError, match="group"):
        parse_policy("rotated(group=0)")
    with pytest.raises(ValueError, match="power-of-two"):
        Rotated().check_shape(layer_shapes(1, 2, 48, 48, 16, torch.float32, CPU))
    with pytest.raises(ValueError, match="does not divide"):
        Rotated(group=24).check_shape(layer_shapes(1, 2, 64, 64, 16, torch.float32, CPU))
    with pytest.raises(ValueError, match="KV heads"):
        Rotated().check_shape(layer_shapes(1, 300, 64, 64, 16, torch.float32, CPU))


def test_the_paged_kernel_reads_rotated_pages_in_place() -> None:
    """A rotated pool on the CPU hands the kernel a page source (no dense decode of the layer)."""
    store = coded_store("rotated(bits=2)", 2, (16, 16), 4, torch.float32)
    seq = store.new_sequence()
    store.append(0, [seq], torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    store.seal(0, [seq])
    pool = store.pools[0]
    assert int(pool.sealed.sum()) == 4 and pool.page_source() is not None
