"""Low-rank codecs: reconstruction error equals the discarded singular energy; ThinK keeps its
channels exactly; an xKV group fits once every layer in it has been seen."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.codec import FitSample, TensorShape
from kvlib.policies.lowrank.basis import fit_basis, head_rows
from kvlib.policies.lowrank.svd import SVD
from kvlib.policies.lowrank.think import ChannelPruner, ThinK
from kvlib.policies.lowrank.xkv import XKV

CPU = torch.device("cpu")


def sample(layer: int, batch: int, heads: int, tokens: int, dim: int, seed: int, query_heads: int | None = None) -> FitSample:
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=generator) * torch.logspace(0, -2, dim)  # decaying spectrum
    keys = torch.randn(batch, heads, tokens, dim, generator=generator) @ mix
    values = torch.randn(batch, heads, tokens, dim, generator=generator) @ mix
    valid = torch.ones(batch, heads, tokens, dtype=torch.bool)
    valid[0, :, : tokens // 3] = False  # left padding of row 0
    queries = torch.randn(batch, query_heads or heads, tokens, dim, generator=generator)
    return FitSample(layer, keys, values, valid, queries, torch.ones(batch, tokens, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 3),
    page_size=st.sampled_from([1, 4, 8]),
    pages=st.integers(1, 6),
    dim=st.sampled_from([2, 4, 8, 16]),
    rank=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_reconstruction_error_is_the_discarded_energy(heads: int, page_size: int, pages: int, dim: int, rank: int, seed: int) -> None:
    tokens = page_size * pages
    fit = sample(0, 1, heads, tokens, dim, seed)
    fit.valid[:] = True
    codec = SVD(rank=rank).layer_codecs([(TensorShape(0, 1, heads, page_size, dim, torch.float32, CPU),) * 2])[0]
    codec.observe(fit)
    if tokens < dim:  # too few tokens to see every direction: the codec waits for more
        assert not codec.ready
        return
    rows = head_rows(fit.keys, fit.valid)
    _, singular = fit_basis(rows, rank, 1.0)
    block = fit.keys[0].reshape(heads * pages, page_size, dim)
    page_heads = torch.arange(heads).repeat_interleave(pages)
    encoded = codec.key.encode(block, page_heads)
    error = (codec.key.decode(encoded, page_heads) - block).square().view(heads, -1).sum(-1)
    discarded = singular[:, min(rank, dim) :].square().sum(-1)
    total = singular.square().sum(-1)
    assert torch.allclose(error, discarded, rtol=1e-3, atol=1e-5 * float(total.max()))
    assert encoded["coefficients"].shape == (heads * pages, page_size, min(rank, dim))


def test_energy_picks_the_smallest_rank_that_keeps_it() -> None:
    fit = sample(0, 2, 2, 40, 8, seed=3)
    rows = head_rows(fit.keys, fit.valid)
    _, singular = fit_basis(rows, 8, 1.0)
    share = singular.square().cumsum(-1) / singular.square().sum(-1, keepdim=True)
    for energy in (0.5, 0.9, 0.99):
        basis, _ = fit_basis(rows, 0, energy)
        rank = basis.shape[-1]
        assert bool((share[:, rank - 1] >= energy - 1e-6).all())
        assert rank == 1 or not bool((share[:, rank - 2] >= energy - 1e-6).all())


def test_padding_rows_do_not_change_the_basis() -> None:
    fit = sample(0, 2, 1, 30, 4, seed=5)
    padded = head_rows(fit.keys, fit.valid)
    real = torch.cat([fit.keys[0, :, 10:], fit.keys[1]], dim=1).transpose(0, 1).reshape(1, -1, 4)
    _, s_padded = fit_basis(padded, 4, 1.0)
    _, s_real = fit_basis(real, 4, 1.0)
    assert torch.allclose(s_padded, s_real, rtol=1e-4)


def test_think_stores_only_kept_channels_and_reads_them_back_exactly() -> None:
    shape = TensorShape(0, 1, 2, 4, 8, torch.float32, CPU)
    pruner = ChannelPruner(shape, keep=0.5, window=4)
    fit = sample(0, 1, 2, 12, 8, seed=1, query_heads=4)
    fit.keys[..., 6] *= 50  # a loud key channel is kept in every head
    pruner.observe(fit, "keys")
    assert pruner.channels.shape == (2, 4) and bool((pruner.channels == 6).any(-1).all())
    block = fit.keys[0, :, :12].reshape(6, 4, 8)
    heads = torch.arange(2).repeat_interleave(3)
    encoded = pruner.encode(block, heads)
    assert encoded["channels"].shape == (6, 4, 4)
    decoded = pruner.decode(encoded, heads)
    for page, head in enumerate(heads.tolist()):
        kept = pruner.channels[head]
        assert torch.equal(decoded[page][:, kept], block[page][:, kept])
        pruned = torch.ones(8, dtype=torch.bool)
        pruned[kept] = False
        assert bool((decoded[page][:, pruned] == 0).all())


def test_think_scores_channels_by_query_and_key_magnitude() -> None:
    shape = TensorShape(0, 1, 1, 4, 4, torch.float32, CPU)
    pruner = ChannelPruner(shape, keep=0.5, window=8)
    keys = torch.ones(1, 1, 8, 4)
    queries = torch.tensor([1.0, 10.0, 0.1, 5.0]).expand(1, 1, 8, 4).clone()
    pruner.observe(FitSample(0, keys, keys, torch.ones(1, 1, 8, dtype=torch.bool), queries, torch.ones(1, 8, dtype=torch.bool)), "keys")
    assert pruner.channels.tolist() == [[1, 3]]


def test_xkv_group_fits_once_all_its_layers_were_seen() -> None:
    shapes = [(TensorShape(i, 3, 2, 4, 8, torch.float32, CPU),) * 2 for i in range(3)]
    codecs = XKV(layers=2, rank=3).layer_codecs(shapes)
    codecs[0].observe(sample(0, 1, 2, 16, 8, seed=0))
    assert not codecs[0].ready and not codecs[1].ready
    codecs[1].observe(sample(1, 1, 2, 16, 8, seed=1))
    assert codecs[0].ready and codecs[1].ready and not codecs[2].ready
    assert codecs[0].key.basis is codecs[1].key.basis or torch.equal(codecs[0].key.basis, codecs[1].key.basis)
    assert codecs[0].state_bytes() > 0 and codecs[1].state_bytes() == 0  # the shared basis is counted once
    codecs[2].observe(sample(2, 1, 2, 16, 8, seed=2))  # the last group has one layer
    assert codecs[2].ready


@pytest.mark.parametrize("spec", [SVD, XKV, ThinK])
def test_bad_parameters_are_rejected(spec) -> None:
    with pytest.raises(ValueError):
        spec(rank=-1) if spec is not ThinK else spec(keep=0.0)
