"""The low-rank codecs' numba page readers equal dequantize-then-attend: a sealed page's scores
against query rows are ``query @ decoded keys`` and its weighted values ``weights @ decoded
values``, the decode being the codec's own float32 one (coefficients times the basis, kept
channels scattered, pages stored as they are), for every compute dtype, any number of query rows
and any fill of the page; heads keeping fewer channels than the layer's width included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, StoreConfig, parse_policy
from kvlib.codec import PageCodec, layer_shapes
from kvlib.policies.lowrank.basis import BasisCodec
from kvlib.policies.lowrank.leank import LeanK, save_mask
from tests.policies.quantization.test_page_readers import assert_pages_read_as_decoded

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
    assert int(pool.sealed.sum()) == 2 * HEADS
    assert_pages_read_as_decoded(pool, dim, rows, filled, seed)
