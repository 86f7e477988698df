"""The low-rank codecs' numba page readers equal dequantize-then-attend: a sealed page's scores
against query rows are ``query @ decoded keys`` and its weighted values ``weights @ decoded
values``, the decode being the codec's own float32 one (coefficients times the basis, kept
channels scattered, pages stored as they are), for every compute dtype, any number of query rows
and any fill of the page; heads keeping fewer channels than the layer's width included."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, StoreConfig, parse_policy
from kvlib.codec import PageCodec, layer_shapes
from kvlib.kernels.page_kernel_parts import padded_rows
from kvlib.kernels.page_readers import numba_reader
from kvlib.policies.lowrank.basis import BasisCodec
from kvlib.policies.lowrank.leank import LeanK, save_mask
from tests.policies.quantization.test_page_readers import TOLERANCE, decoded

HEADS = 2


def codecs(kind: str, dtype: torch.dtype, dim: int, tmp_path, generator: torch.Generator) -> list[PageCodec]:
    """One layer's codec of ``kind``: ``basis`` (svd with a random orthonormal basis per head for
    keys and values), ``basis+plain`` (svd of keys only) or ``mask`` (leank: heads keeping
    ``dim / 2`` and ``dim / 4`` key channels, values as they are)."""
    shapes = layer_shapes(1, HEADS, dim, dim, 16, dtype, torch.device("cpu"))
    if kind == "mask":
        kept = [sorted(torch.randperm(dim, generator=generator)[: dim // d].tolist()) for d in (2, 4)]
        path = tmp_path / f"mask-{dim}.json"
        save_mask(path, [kept], {"by": "test"})
        return LeanK(mask=str(path)).layer_codecs(shapes)
    spec = {"basis": "svd(rank=3)", "basis+plain": "svd(rank=5, values=False)"}[kind]
    layer = parse_policy(spec).layer_codecs(shapes)
    for codec in (layer[0].key, layer[0].value):
        if isinstance(codec, BasisCodec):
            rank = 3 if kind == "basis" else 5
            basis = torch.linalg.qr(torch.randn(HEADS, dim, dim, generator=generator)).Q[..., :rank]
            codec.set_basis(basis)
    return layer


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["basis", "basis+plain", "mask"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    dim=st.sampled_from([8, 32, 64]),
    rows=st.integers(1, 9),
    filled=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_a_sealed_page_reads_as_its_float32_decode(tmp_path_factory, kind, dtype, dim, rows, filled, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    layer = codecs(kind, dtype, dim, tmp_path_factory.mktemp("mask"), generator)
    store = PagedStore(StoreConfig(1, HEADS, dim, page_size=16, dtype=dtype, codecs=layer, read_cache=False))
    seq = store.new_sequence()
    scale = torch.rand(dim, generator=generator) * 4 + 0.1
    tokens = lambda: (torch.randn(1, HEADS, 40, dim, generator=generator) * scale).to(dtype)  # noqa: E731
    store.append(0, [seq], tokens(), tokens())
    store.seal(0, [seq])
    pool = store.pools[0]
    keys, values = pool.format.kernel_readers
    key_reader, value_reader = numba_reader(keys.kernel), numba_reader(values.kernel)
    key_fields, value_fields = key_reader.fields(keys.fields, keys.params), value_reader.fields(values.fields, values.params)
    rng = np.random.default_rng(seed)
    padded = padded_rows(rows)
    query = np.zeros((padded, dim), dtype=np.float32)
    query[:rows] = rng.standard_normal((rows, dim), dtype=np.float32)
    weights = np.zeros((2 * padded, 16), dtype=np.float32)
    weights[:rows, :filled] = rng.random((rows, filled), dtype=np.float32)
    decoded_keys, decoded_values = decoded(pool, "key").double().numpy(), decoded(pool, "value").double().numpy()
    sealed = pool.sealed.nonzero().squeeze(-1).tolist()
    assert len(sealed) == 2 * HEADS
    for page in sealed:
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
