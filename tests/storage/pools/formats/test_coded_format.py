"""A coded pool's pages as block-record fields: a sealed page leaves as its encoded fields and
comes back sealed, reading exactly as it did; open pages and fitted codecs give no record."""

from __future__ import annotations

import torch

from kvlib.codec import layer_shapes
from kvlib.spec import parse_spec
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.page_pool import PagePool

PAGE, DIM = 16, 32


def pool(spec: str | None) -> PagePool:
    shape = {"page_size": PAGE, "head_dim": DIM, "value_dim": DIM, "dtype": torch.float32, "device": torch.device("cpu")}
    if spec is None:
        return PagePool(**shape)
    policy = parse_spec(spec).quantization or parse_spec(spec).lowrank
    codec = policy.layer_codecs(layer_shapes(1, 2, DIM, DIM, PAGE, torch.float32, torch.device("cpu")))[0]
    return PagePool(**shape, format=CodedPages(codec))


def filled(target: PagePool, pages: int, seed: int = 0) -> torch.Tensor:
    ids = target.allocate(pages, torch.arange(pages) % 2)
    generator = torch.Generator().manual_seed(seed)
    slots = (ids.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten()
    keys, values = (torch.randn(pages * PAGE, DIM, generator=generator) for _ in range(2))
    target.write(slots, keys, values, torch.arange(pages * PAGE))
    return ids


def test_a_sealed_page_round_trips_as_its_fields() -> None:
    source = pool("kivi(bits=4)")
    ids = filled(source, 2)
    source.seal(ids[:1])
    assert source.record_pages(ids) is None  # the second page is open
    fields = source.record_pages(ids[:1])
    assert set(fields) == set(source.record_fields()) and all(t.shape[0] == 1 for t in fields.values())
    target = pool("kivi(bits=4)")
    restored = target.allocate(1, torch.tensor([0]))
    target.restore_pages(restored, fields, torch.arange(100, 100 + PAGE).unsqueeze(0))
    assert bool(target.sealed[restored].all())
    for got, want in zip(target.read_pages(restored), source.read_pages(ids[:1])):
        assert torch.equal(got, want)
    assert target.positions[restored].tolist() == [list(range(100, 100 + PAGE))]


def test_exact_pages_round_trip_as_keys_and_values() -> None:
    source, target = pool(None), pool(None)
    ids = filled(source, 2, seed=1)
    fields = source.record_pages(ids)
    assert set(fields) == {"keys", "values"} == set(source.record_fields())
    restored = target.allocate(2)
    target.restore_pages(restored, fields, torch.arange(2 * PAGE).view(2, PAGE))
    for got, want in zip(target.read_pages(restored), source.read_pages(ids)):
        assert torch.equal(got, want)


def test_a_codec_fitted_to_data_gives_no_record_fields() -> None:
    assert pool("svd(rank=8)").record_fields() is None
