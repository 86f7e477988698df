"""kvlib's page operators: a planned step's write and decode equal what the store and the kernel
give, the coded decode operator takes only tensors, ints, floats and strs (so it traces whole and
caches of one codec share a compiled graph), its fake gives the shape alone, and on the CPU the
operators dispatch no torch operator inside but the output's allocation."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from kvlib.codec import layer_shapes
from kvlib.kernels import paged_ops
from kvlib.spec_text import parse_policy
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.store_config import StoreConfig

DIM = 16


def planned_store(spec: str | None, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A two-layer store (two KV heads, pages of 4 tokens) holding two ragged rows, full pages sealed
    where ``spec`` is a codec, and a planned step's tokens written: ``(store, rows, plan)``."""
    generator = torch.Generator().manual_seed(seed)
    codecs = None
    if spec is not None:
        codecs = parse_policy(spec).layer_codecs(layer_shapes(2, 2, DIM, DIM, 4, dtype, torch.device("cpu")))
    store = PagedStore(StoreConfig(2, 2, DIM, page_size=4, dtype=dtype, codecs=codecs, read_cache=False))
    rows = [store.new_sequence(), store.new_sequence()]
    for layer in range(2):
        store.append(
            layer, rows, torch.randn(2, 2, 9, DIM, generator=generator).to(dtype), torch.randn(2, 2, 9, DIM, generator=generator).to(dtype)
        )
        store.append(
            layer,
            rows[:1],
            torch.randn(1, 2, 5, DIM, generator=generator).to(dtype),
            torch.randn(1, 2, 5, DIM, generator=generator).to(dtype),
        )
        if spec is not None:
            store.seal(layer, rows)
    plan = store.plan_step(rows, 1)
    assert plan is not None
    for layer in range(2):
        plan.pools[layer].format.write_planned(
            plan, layer, torch.randn(2, 2, 1, DIM, generator=generator).to(dtype), torch.randn(2, 2, 1, DIM, generator=generator).to(dtype)
        )
    return store, rows, plan


def paged_reference(store: PagedStore, rows: list[int], layer: int, query: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The unplanned read of the same pages: the store's paged layer (the same kernel, through a block table)."""
    paged = store.paged_layer(layer, rows)
    causal = None if mask is not None else torch.tensor([int(store.logical_lengths(layer, rows).max()) - 1])
    return paged.attend(query, visible=None if mask is None else mask[:, 0], query_positions=causal, scale=0.25).transpose(1, 2)


@pytest.mark.parametrize("spec", [None, "kivi(bits=4)", "int8", "rotated(bits=2)"], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_planned_decode_equals_the_paged_layer_over_the_same_pages(spec: str | None, dtype: torch.dtype) -> None:
    store, rows, plan = planned_store(spec, dtype)
    query = torch.randn(2, 4, 1, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    logical = int(store.logical_lengths(0, rows).max())
    mask = torch.ones(2, 1, 1, logical, dtype=torch.bool)
    mask[1, ..., :3] = False
    for layer in range(2):
        for given in (None, mask, torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)):
            got = plan.pools[layer].format.attend_planned(plan, layer, query, given, 0.25)
            expected = paged_reference(store, rows, layer, query, None if given is None else mask)
            assert got.shape == (2, 1, 4, DIM) and got.dtype == dtype
            torch.testing.assert_close(got, expected)


def test_a_planned_write_lands_where_the_store_reads_it() -> None:
    store, rows, plan = planned_store(None)
    new_keys = torch.randn(2, 2, 1, DIM)
    new_values = torch.randn(2, 2, 1, DIM)
    plan.pools[1].format.write_planned(plan, 1, new_keys, new_values)
    read = store.read(1, rows, mirror=False)
    for b in range(2):
        length = int(store.physical_lengths(1, rows)[b, 0])
        torch.testing.assert_close(read.keys[b, :, length - 1], new_keys[b, :, 0])
        torch.testing.assert_close(read.values[b, :, length - 1], new_values[b, :, 0])
        assert (read.positions[b, :, length - 1] == plan.positions[b, 0]).all()


def coded_step(store: PagedStore, plan, query: torch.Tensor) -> torch.Tensor:
    """Layer 0's coded decode operator, called with the pool's tensors and readers only."""
    pool = plan.pools[0].format
    keys, values = pool.kernel_readers
    return paged_ops.paged_decode_coded(
        query, pool.keys, pool.values, pool.pool.positions, plan.pages, plan.lengths, 0, None, plan.query_positions, 0.25, None,
        pool.kernel_sealed, pool.kernel_raw_row, keys, values,
    )  # fmt: skip


def test_the_coded_decode_traces_whole_and_caches_of_a_codec_share_its_graph() -> None:
    """No Python object crosses the operator (fullgraph, no break); a second cache of the same codec,
    other tensors of the same shapes, runs the same compiled graph."""
    counter = CompileCounter()
    step = torch.compile(coded_step, backend=counter, fullgraph=True)
    query = torch.randn(2, 4, 1, DIM)
    try:
        for seed in (0, 1):
            store, _, plan = planned_store("kivi(bits=4)", seed=seed)
            torch.testing.assert_close(step(store, plan, query), coded_step(store, plan, query))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1 and counter.op_count >= 1


def test_the_fakes_give_shapes_and_the_schemas_hold() -> None:
    store, rows, plan = planned_store("kivi(bits=2)")
    pool = plan.pools[0].format
    keys, values = pool.kernel_readers
    query = torch.randn(2, 4, 1, DIM)
    received = torch.zeros(2, 2, 32)
    arguments = (
        query, pool.keys, pool.values, pool.pool.positions, plan.pages, plan.lengths, 0, None, plan.query_positions, 0.25, 0.0,
        pool.kernel_sealed, pool.kernel_raw_row, list(keys.fields), keys.kernel, list(keys.params), list(values.fields),
        values.kernel, list(values.params), received,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.kvlib.paged_decode_coded.default, arguments, test_utils=("test_schema", "test_faketensor"))
    floats = planned_store(None)[2]
    float_pool = floats.pools[0].format
    torch.library.opcheck(
        torch.ops.kvlib.paged_decode.default,
        (query, float_pool.keys, float_pool.values, float_pool.pool.positions, floats.pages, floats.lengths, 0, None, floats.query_positions, 0.25, 0.0, received),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@pytest.mark.parametrize("spec", [None, "kivi(bits=4)"], ids=str)
def test_on_the_cpu_the_operators_dispatch_nothing_inside_but_the_output(spec: str | None) -> None:
    store, rows, plan = planned_store(spec)
    pool = plan.pools[0]
    query, keys, values = torch.randn(2, 4, 1, DIM), torch.randn(2, 2, 1, DIM), torch.randn(2, 2, 1, DIM)
    pool.format.write_planned(plan, 0, keys, values)
    pool.format.attend_planned(plan, 0, query, None, 0.25)  # views of the long-lived tensors are made once
    with torch.profiler.profile() as profile:
        pool.format.write_planned(plan, 0, keys, values)
        pool.format.attend_planned(plan, 0, query, None, 0.25)
    inside = [
        e.name
        for e in profile.events()
        if e.name.startswith("aten::") and e.cpu_parent is not None and e.cpu_parent.name.startswith("kvlib::")
    ]
    assert inside == ["aten::empty"]
