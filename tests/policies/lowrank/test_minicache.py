"""MiniCache: the SLERP merge, paired sealing in the store, partner references that keep a
shallow page alive while a deep page leans on it, and no page leaked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import PagedStore, StoreConfig
from kvlib.codec import layer_shapes
from kvlib.policies.lowrank.minicache import MiniCache, merge_pages
from kvlib.storage.pools.formats.partnered_format import PartneredPages


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), t=st.floats(0.0, 1.0), retained=st.integers(0, 4), dim=st.sampled_from([2, 8, 32]))
def test_merged_direction_is_the_slerp_and_retained_tokens_stay_exact(seed: int, t: float, retained: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(3, 8, dim, generator=generator, dtype=torch.float64).float()
    b = (a + 0.7 * torch.randn(3, 8, dim, generator=generator)) * 2
    direction, norm_a, norm_b, kept, slots = merge_pages(a, b, t, retained)
    assert torch.allclose(norm_a, a.norm(dim=-1)) and torch.allclose(norm_b, b.norm(dim=-1))
    assert torch.allclose(direction.norm(dim=-1), torch.ones(3, 8), atol=1e-5)
    unit_a, unit_b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    angle = (unit_a * unit_b).sum(-1).clamp(-1, 1).acos()
    to_a = (direction * unit_a).sum(-1).clamp(-1, 1).acos()
    is_kept = torch.zeros(3, 8, dtype=torch.bool).scatter_(1, slots, True)
    # merged tokens sit on the great circle, t of the way from the shallow to the deep direction
    assert torch.allclose(to_a[~is_kept], (t * angle)[~is_kept], atol=2e-3)
    # kept tokens: the largest angles; shallow direction exact, deep token stored whole
    for page in range(3):  # per page
        if retained:
            assert angle[page][is_kept[page]].min() >= angle[page][~is_kept[page]].max() - 1e-6
    assert torch.allclose(direction[is_kept], unit_a[is_kept], atol=1e-6)
    assert torch.equal(kept, b.gather(1, slots.unsqueeze(-1).expand(-1, -1, dim)))


def minicache_store(layers: int = 4, page_size: int = 4, **params) -> tuple[PagedStore, MiniCache]:
    policy = MiniCache(**params)
    codecs = policy.layer_codecs(layer_shapes(layers, 2, 8, 8, page_size, torch.float32, torch.device("cpu")))
    return PagedStore(StoreConfig(layers, 2, 8, page_size=page_size, codecs=codecs, read_cache=False)), policy


def test_pairs_are_sealed_together_and_decode_to_the_merge() -> None:
    store, policy = minicache_store(retain=0.25)  # pairs (2, 3); one token per 4-token page kept
    seq = store.new_sequence()
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(1, 2, 10, 8, generator=generator) for _ in range(4)]
    for layer in range(4):
        store.append(layer, [seq], data[layer], -data[layer])
    assert store.seal(2, [seq]) == 0  # the shallow layer waits for its partner
    assert store.seal(3, [seq]) == 4  # 10 tokens: two full pages per head, paired
    shallow, deep = store.pools[2], store.pools[3]
    assert isinstance(deep.format, PartneredPages) and int(shallow.sealed.sum()) == int(deep.sealed.sum()) == 4
    assert bool((shallow.refcount[deep.partner[deep.sealed]] == 2).all())  # table + partner reference
    direction, norm_a, norm_b, kept, slots = merge_pages(
        data[2][0, :, :8].reshape(4, 4, 8), data[3][0, :, :8].reshape(4, 4, 8), policy.t, 1
    )
    expected_deep = (direction * norm_b.unsqueeze(-1)).scatter(1, slots.unsqueeze(-1).expand(-1, -1, 8), kept)
    read = store.read(3, [seq])
    assert torch.allclose(read.keys[0, :, :8], expected_deep.reshape(2, 8, 8), atol=1e-5)
    assert torch.equal(read.keys[0, :, 8:10], data[3][0, :, 8:10])  # the open page: exact
    assert torch.allclose(store.read(2, [seq]).keys[0, :, :8], (direction * norm_a.unsqueeze(-1)).reshape(2, 8, 8), atol=1e-5)
    for layer in (0, 1):  # layers before start are stored as they are
        assert torch.equal(store.read(layer, [seq]).keys, data[layer])


def test_a_deep_page_keeps_its_partner_alive_and_nothing_leaks() -> None:
    store, _ = minicache_store()
    seq = store.new_sequence()
    for layer in range(4):
        store.append(layer, [seq], torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8))
    store.seal(3, [seq])
    before = store.read(3, [seq]).keys.clone()
    keep = torch.tensor([[[0, 5, 11], [1, 2, 3]]])
    store.compact(2, [seq], keep)  # the shallow layer evicts: its old pages stay alive for layer 3
    assert torch.equal(store.read(3, [seq]).keys, before)
    store.truncate(3, [seq], 6)  # ends inside a sealed deep page: it reopens from the decoded tokens
    assert torch.allclose(store.read(3, [seq]).keys[0, :, :6], before[0, :, :6])
    store.append(3, [seq], torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    store.release([seq])
    assert all(pool.pages_in_use == 0 for pool in store.pools)


def test_pages_holding_different_tokens_stay_open() -> None:
    store, _ = minicache_store()
    seq = store.new_sequence()
    for layer in range(4):
        store.append(layer, [seq], torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))
    store.compact(3, [seq], torch.tensor([[[0, 2, 3, 4, 5, 6, 7, -1], [0, 1, 2, 3, 4, 5, 6, 7]]]))  # head 0 of layer 3 dropped token 1
    assert store.seal(3, [seq]) == 2  # head 1: two pages pair; head 0: its pages hold other tokens
    deep = store.pools[3]
    head0 = store.tables[3].pages[seq, 0, :2]
    assert not bool(deep.sealed[head0[head0 >= 0]].any())


def test_minicache_needs_a_pair() -> None:
    with pytest.raises(ValueError, match="no pair to merge"):
        MiniCache(start=0.75).check_shape(layer_shapes(2, 2, 8, 8, 4, torch.float32, torch.device("cpu")))
    assert MiniCache().pairs(5) == [(3, 4)] and MiniCache(start=0.0).pairs(5) == [(0, 1), (2, 3)]
