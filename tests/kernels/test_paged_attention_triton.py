"""The Triton paged decode kernels equal the numba kernel and float64 attention over the dense
layer: float arenas (GQA, ragged heads, pages of 4 to 16 tokens, masks with holes, causal
positions, soft-capping, several splits) and coded pools (open pages raw, sealed pages decoded in registers) of every
codec with a Triton reader. On a machine without CUDA the kernels run under Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before any
kernel is defined: triton reads it when its decorators run); with CUDA they run on the GPU."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import layer_shapes
from kvlib.kernels.paged_attention import arena_source, paged_attention
from kvlib.kernels.paged_scores import attention_weights
from kvlib.spec_text import parse_policy
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig
from tests.kernels.test_paged_attention import TOLERANCE, scattered_pages
from tests.policies.quantization.test_page_loaders import coded_store, fill

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernels run: the GPU, else the CPU under Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET``)."""
pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra installs it)")
kernels = importlib.import_module("kvlib.kernels.paged_attention_triton")
triton = importlib.import_module("triton")
tl = importlib.import_module("triton.language")
e4m3_value = importlib.import_module("kvlib.policies.quantization.triton_loaders.scaled_bytes").e4m3_value
for _loaders in ("group", "rotated"):  # importing a loader module registers its loader (on CUDA the codecs import them)
    importlib.import_module(f"kvlib.policies.quantization.triton_loaders.{_loaders}")
products = importlib.import_module("kvlib.kernels.triton_products")

TRITON_CODECS = [
    "kivi(bits=2)",
    "kivi(bits=4, group=4)",
    "kivi(bits=8)",
    "kivi(bits=3, group=4)",
    "kv_bits(key_bits=3, value_bits=2)",
    "kv_bits(key_bits=8, value_bits=4, group=8)",
    "int8",
    "fp8",
    "rotated(bits=2)",
    "rotated(bits=4, group=4)",
    "rotated(bits=3)",
    "rotated(bits=2, key_bits=8)",
]
"""Codecs whose sealed pages the kernel decodes in registers: every bit width and layout of the
group quantizers (rotated's last: per-token key groups), int8, fp8."""


def visibility(lengths: torch.Tensor, queries: int, kind: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_positions [queries], visible [batch, queries, logical])`` for the last ``queries``
    positions past the longest head: ``kind`` ``"causal"`` (the mask is what the positions
    imply), ``"window"`` (left padding and a sliding window of 7) or ``"holes"`` (causal with a
    third of the positions masked at random)."""
    logical = int(lengths.max()) + 5 + queries
    query_positions = torch.arange(logical - queries, logical)
    columns = torch.arange(logical)
    visible = (columns <= query_positions.view(-1, 1)).unsqueeze(0).expand(lengths.shape[0], -1, -1)
    if kind == "window":
        padding = torch.randint(0, 4, (lengths.shape[0], 1, 1), generator=generator)
        visible = visible & (columns >= padding) & (query_positions.view(-1, 1) - columns < 7)
    elif kind == "holes":
        visible = visible & (torch.rand(visible.shape, generator=generator) > 0.3)
    return query_positions, visible.contiguous()


def reference(query, dense_keys, dense_values, dense_positions, visible, scale, softcap) -> torch.Tensor:
    """Attention in float64 over the dense slots (positions -1 past a head's length), each slot
    masked by its position's visibility; zeros for a query that sees nothing."""
    batch, query_heads, queries, _ = query.shape
    kv_heads = dense_keys.shape[1]
    group = query_heads // kv_heads
    columns = dense_positions.clamp(min=0).unsqueeze(2).expand(-1, -1, queries, -1)
    allowed = visible.unsqueeze(1).expand(-1, kv_heads, -1, -1).gather(-1, columns) & (dense_positions >= 0).unsqueeze(2)
    scores = (query.double() @ dense_keys.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed.repeat_interleave(group, 1), float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ dense_values.double().repeat_interleave(group, 1)


def options(query_positions, visible, kind, scale, softcap) -> dict:
    """The kernels' visibility keywords: causal by positions for ``"causal"``, else the mask."""
    causal = kind == "causal"
    return dict(visible=None if causal else visible, query_positions=query_positions if causal else None, scale=scale, softcap=softcap)


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` on :data:`DEVICE`."""
    return [t.to(DEVICE) for t in tensors]


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    queries=st.sampled_from([1, 2, 3, 16]),
    page_size=st.sampled_from([4, 6, 8, 16]),
    dims=st.sampled_from([(8, 8), (16, 16), (32, 32), (16, 8)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    kind=st.sampled_from(["causal", "window", "holes"]),
    softcap=st.sampled_from([None, 5.0]),
    splits=st.sampled_from([None, 1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_numba_kernel_and_float64_attention(
    batch, kv_heads, group, queries, page_size, dims, dtype, kind, softcap, splits, seed
):
    generator = torch.Generator().manual_seed(seed)
    dim, value_dim = dims
    lengths = torch.randint(0, 100, (batch, kv_heads), generator=generator)
    lengths[0, 0] = 0 if seed % 3 == 0 else lengths[0, 0]  # a head that holds nothing
    keys, values, positions, pages, dense_keys, dense_values, dense_positions = scattered_pages(
        lengths, page_size, dim, value_dim, dtype, generator
    )
    query_positions, visible = visibility(lengths, queries, kind, generator)
    query = torch.randn(batch, kv_heads * group, queries, dim, generator=generator).to(dtype)
    common = options(query_positions, visible, kind, dim**-0.5, softcap)
    source = kernels.triton_arena_source(*on_device(keys, values, positions))
    out = kernels.attend_pages_triton(query.to(DEVICE), source, pages, lengths, splits=splits, **common)
    assert out.device.type == DEVICE.type and out.dtype == dtype and out.shape == (batch, kv_heads * group, queries, value_dim)
    out = out.cpu().double()
    tolerance = TOLERANCE[dtype]
    numba = paged_attention(query, keys, values, positions, pages, lengths, **common)
    torch.testing.assert_close(out, numba.double(), atol=tolerance, rtol=tolerance)
    expected = reference(query, dense_keys, dense_values, dense_positions, visible, dim**-0.5, softcap)
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    queries=st.integers(1, 3),
    page_size=st.sampled_from([4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kind=st.sampled_from(["causal", "holes"]),
    softcap=st.sampled_from([None, 5.0]),
    seed=st.integers(0, 2**16),
)
def test_weights_equal_the_numba_kernels(batch, kv_heads, group, queries, page_size, dtype, kind, softcap, seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 70, (batch, kv_heads), generator=generator)
    keys, values, positions, pages, *_ = scattered_pages(lengths, page_size, 16, 16, dtype, generator)
    query_positions, visible = visibility(lengths, queries, kind, generator)
    query = torch.randn(batch, kv_heads * group, queries, 16, generator=generator).to(dtype)
    common = options(query_positions, visible, kind, 0.25, softcap)
    weights = kernels.triton_arena_source(*on_device(keys, values, positions)).weights(query.to(DEVICE), pages, lengths, **common)
    expected = attention_weights(query, arena_source(keys, values, positions), pages, lengths, **common)
    assert weights.dtype == torch.float32 and weights.shape == expected.shape
    torch.testing.assert_close(weights.cpu(), expected, atol=1e-5, rtol=1e-4)


def decoded_arenas(pool: PagePool) -> tuple[torch.Tensor, torch.Tensor]:
    """A coded pool's pages as float32 arenas ``[capacity, page_size, dim]``: sealed pages by its
    codec's ``decode_into`` a float32 buffer (no rounding to the compute dtype, as the kernels
    read them), open pages raw."""
    keys = torch.zeros(pool.capacity, pool.page_size, pool.head_dim)
    values = torch.zeros(pool.capacity, pool.page_size, pool.value_dim)
    sealed = pool.sealed.nonzero().squeeze(-1)
    if sealed.numel():
        pool.codec.decode_into(pool.encoded, sealed, pool.page_heads[sealed], keys, values, sealed)
    opened = (pool.raw_row >= 0).nonzero().squeeze(-1)
    keys[opened], values[opened] = pool.keys[pool.raw_row[opened]].float(), pool.values[pool.raw_row[opened]].float()
    return keys, values


def coded_case(spec, batch, kv_heads, group, queries, page_size, dims, dtype, kind, splits, seed):
    """A one-layer coded store filled with ragged sequences (full pages sealed), a query and a
    mask: ``(pool, paged layer by the numba kernel, query, mask, visibility keywords, Triton
    output on the CPU)``."""
    generator = torch.Generator().manual_seed(seed)
    store = coded_store(spec, kv_heads, dims, page_size, dtype)
    seqs = fill(store, batch, generator)
    paged = store.paged_layer(0, seqs)
    query_positions, visible = visibility(store.logical_lengths(0, seqs), queries, kind, generator)
    query = torch.randn(batch, kv_heads * group, queries, dims[0], generator=generator).to(dtype)
    common = options(query_positions, visible, kind, dims[0] ** -0.5, None)
    pool = store.pools[0]
    fields = {name: arena.to(DEVICE) for name, arena in (pool.encoded or pool.format._field_arenas(0)).items()}  # none sealed yet: none
    readers = pool.codec.kernel_readers(fields)
    assert readers is not None and kernels.has_triton_loaders(*readers)
    source = kernels.triton_coded_source(*on_device(pool.keys, pool.values), pool.sealed, pool.raw_row, pool.positions.to(DEVICE), *readers)
    assert source.value_dim == dims[1]
    out = kernels.attend_pages_triton(query.to(DEVICE), source, paged.pages, paged.lengths, splits=splits, **common)
    assert out.dtype == dtype and out.shape == (batch, kv_heads * group, queries, dims[1])
    return pool, paged, query, visible, common, out.cpu()


CODED_CASES = dict(
    spec=st.sampled_from(TRITON_CODECS),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    queries=st.integers(1, 3),
    page_size=st.sampled_from([4, 8, 16]),
    dims=st.sampled_from([(8, 8), (16, 16), (32, 32), (16, 8)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    kind=st.sampled_from(["causal", "window"]),
    splits=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)


def power_of_two_dims(case: dict) -> dict:
    """``case`` with equal key and value dims for the rotated codec (a Hadamard rotation per tensor)."""
    return case | {"dims": (case["dims"][0], case["dims"][0])} if case["spec"].startswith("rotated") else case


@settings(max_examples=30, deadline=None)
@given(**CODED_CASES)
def test_kernel_over_coded_pages_equals_the_kernels_and_float64_attention_over_their_decode(**case):
    """Against the numba kernel over the pages the codec decodes (float32 arenas, one numba
    compilation for every codec; the coded numba path equals that, tests/policies/quantization/
    test_page_loaders.py) and float64 attention over them."""
    case = power_of_two_dims(case)
    pool, paged, query, visible, common, out = coded_case(**case)
    keys, values = decoded_arenas(pool)
    tolerance = TOLERANCE[case["dtype"]]
    numba = paged_attention(query, keys, values, pool.positions, paged.pages, paged.lengths, **common)
    torch.testing.assert_close(out.double(), numba.double(), atol=tolerance, rtol=tolerance)
    pages = paged.pages.clamp(min=0)
    slots = torch.arange(pages.shape[2] * pool.page_size)
    dense_positions = torch.where(slots < paged.lengths.unsqueeze(-1), pool.positions[pages].flatten(2, 3), -1)
    expected = reference(query, keys[pages].flatten(2, 3), values[pages].flatten(2, 3), dense_positions, visible, common["scale"], None)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(**CODED_CASES)
def test_kernel_over_coded_pages_equals_the_coded_numba_kernel(**case):
    """Against the numba kernel reading the same coded pages (its codec loaders: one numba
    compilation per codec layout, hence slow)."""
    case = power_of_two_dims(case)
    _, paged, query, _, common, out = coded_case(**case)
    tolerance = TOLERANCE[case["dtype"]]
    torch.testing.assert_close(out.double(), paged.attend(query, **common).double(), atol=tolerance, rtol=tolerance)


def store_on_device(spec: str, page_size: int) -> PagedStore:
    """A one-layer store of one KV head (head dim 16) on :data:`DEVICE` whose sealed pages ``spec``'s codec encodes."""
    shapes = layer_shapes(1, 1, 16, 16, page_size, torch.float32, DEVICE)
    codecs = parse_policy(spec).layer_codecs(shapes)
    return PagedStore(StoreConfig(1, 1, 16, page_size=page_size, dtype=torch.float32, device=DEVICE, codecs=codecs, read_cache=False))


def test_a_pool_with_nothing_sealed_yet_is_read_raw() -> None:
    store = store_on_device("kivi(bits=2)", 4)
    seq = store.new_sequence()
    keys, values = torch.randn(1, 1, 6, 16, device=DEVICE), torch.randn(1, 1, 6, 16, device=DEVICE)
    store.append(0, [seq], keys, values)  # no seal: both pages open, no field arena yet
    pool = store.pools[0]
    assert not pool.encoded
    source = pool.triton_source()
    table = store.tables[0]
    pages, lengths = table.pages[store._rows([seq])][:, :, :2], store.physical_lengths(0, [seq])
    query = torch.randn(1, 2, 1, 16, device=DEVICE)
    visible = torch.ones(1, 1, 7, dtype=torch.bool)
    out = kernels.attend_pages_triton(query, source, pages, lengths, visible=visible, query_positions=None, scale=0.25)
    expected = reference(query.cpu(), keys.cpu(), values.cpu(), torch.arange(6).view(1, 1, 6), visible, 0.25, None)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("spec", ["gear", "mixed"])
def test_codecs_without_a_triton_reader_give_no_source(spec: str) -> None:
    store = store_on_device(spec, 4)
    seq = store.new_sequence()
    store.append(0, [seq], torch.randn(1, 1, 9, 16, device=DEVICE), torch.randn(1, 1, 9, 16, device=DEVICE))
    store.seal(0, [seq])
    assert store.pools[0].codec.ready and store.pools[0].triton_source() is None


@triton.jit
def _e4m3_values(codes, out):
    index = tl.arange(0, 256)
    tl.store(out + index, e4m3_value(tl.load(codes + index)))


def test_every_e4m3_pattern_reads_as_torchs_float8() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, device=DEVICE)
    _e4m3_values[(1,)](codes.to(DEVICE), out)
    torch.testing.assert_close(out.cpu(), codes.view(torch.float8_e4m3fn).float(), equal_nan=True, atol=0, rtol=0)


@triton.jit
def _products(a, b, signs, split_out, exact_out, DOT: tl.constexpr):
    rows = tl.arange(0, 32)[:, None] * 16
    columns = tl.arange(0, 16)[None, :]
    left = tl.load(a + rows + columns)
    square = tl.arange(0, 16)[:, None] * 16 + columns
    tl.store(split_out + rows + columns, products.split_dot(left, tl.load(b + square), DOT))
    tl.store(exact_out + rows + columns, products.dot_exact_right(left, tl.load(signs + square), DOT))


@pytest.mark.parametrize(
    "dot, tolerance",
    [
        ("float32", 1e-6),
        ("float16", 1e-6),
        pytest.param("bfloat16", 1e-4, marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="needs a CUDA device")),
    ],
)
def test_split_products_keep_float32s_precision(dot: str, tolerance: float) -> None:
    """Products in a half dtype (split operands, float32 accumulation) agree with float64 ones to
    the parts' precision: 22 (float16) or 16 (bfloat16) bits for :func:`split_dot`, 24 for
    :func:`dot_exact_right` against a matrix of signs. (Triton's interpreter gets bfloat16
    wrong: that case runs on a GPU only.)"""
    generator = torch.Generator().manual_seed(5)
    a, b = torch.randn(32, 16, generator=generator), torch.randn(16, 16, generator=generator)
    signs = torch.randint(0, 2, (16, 16), generator=generator).float() * 2 - 1
    split, exact = torch.empty(32, 16, device=DEVICE), torch.empty(32, 16, device=DEVICE)
    _products[(1,)](*on_device(a, b, signs), split, exact, DOT=getattr(tl, dot))
    torch.testing.assert_close(split.cpu().double(), a.double() @ b.double(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(exact.cpu().double(), a.double() @ signs.double(), atol=1e-6, rtol=1e-6)


def test_splits_follow_the_longest_head_and_the_programs_a_batch_already_fills() -> None:
    assert kernels.split_plan(200, 8) == (1, 224)  # short: one split of whole tiles
    count, tokens = kernels.split_plan(4096, 8)
    assert count == 16 and tokens == 256 and tokens % kernels.TILE_TOKENS == 0
    assert kernels.split_plan(4096, 512) == (1, 4096)  # the batch fills the GPU already
    assert kernels.split_plan(100_000, 1)[0] == kernels.MAX_SPLITS
    assert kernels.split_plan(40, 8, splits=5) == (2, 32)  # no more splits than tiles
    assert kernels.split_plan(0, 8) == (1, 32)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        kernels.split_plan(40, 8, splits=0)


def test_nothing_stored_or_nothing_visible_gives_zeros() -> None:
    lengths = torch.tensor([[5, 0]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 4, 8, 8, torch.float16, torch.Generator().manual_seed(4))
    source = kernels.triton_arena_source(*on_device(keys, values, positions))
    query = torch.randn(1, 2, 1, 8, dtype=torch.float16, device=DEVICE)
    blind = torch.zeros(1, 1, 0, dtype=torch.bool)  # a mask over no positions
    for table, held, mask in ((pages[:, :, :0], torch.zeros(1, 2, dtype=torch.int64), None), (pages, lengths, blind)):
        common = dict(visible=mask, query_positions=torch.tensor([9]), scale=1.0)
        out = source.attend(query, table, held, **common)
        assert out.dtype == torch.float16 and out.shape == (1, 2, 1, 8) and not out.any()
        assert not source.weights(query, table, held, **common).any()


def test_mismatched_heads_missing_visibility_and_unsupported_dtypes_are_refused() -> None:
    lengths = torch.tensor([[4, 4]])
    keys, values, positions, pages, *_ = scattered_pages(lengths, 4, 8, 8, torch.float32, torch.Generator().manual_seed(3))
    source = kernels.triton_arena_source(keys, values, positions)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        source.attend(torch.randn(1, 3, 1, 8), pages, lengths, visible=None, query_positions=torch.tensor([9]), scale=1.0)
    with pytest.raises(ValueError, match="needs the model's mask"):
        source.attend(torch.randn(1, 2, 1, 8), pages, lengths, visible=None, query_positions=None, scale=1.0)
    with pytest.raises(ValueError, match="pages must be one of"):
        kernels.triton_arena_source(keys.double(), values.double(), positions)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.triton_arena_source(keys.transpose(1, 2), values, positions)
