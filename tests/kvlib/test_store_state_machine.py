"""Stateful property test of the page pool and paged store against a plain Python model.

Random appends (varied batches, token counts, explicit or default positions), compactions with
random keep sets, forks, writes to forked sequences, decode-style append+read loops through the
read cache, and releases. After every step: no page leaked or freed twice, reference counts equal
block-table references, ``bytes_in_use`` equals pages in use times page bytes, and every live
sequence reads back exactly its model: the tokens appended minus those compacted away, in order,
with their positions (so a write or compaction never changes what a sharing sequence reads).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlib import PagedStore

HEADS = (2, 3)
KEY_DIMS = (2, 3)
VALUE_DIMS = (3, 1)

Token = tuple[int, int]  # (token id, position)


def key_of(token: int, dim: int) -> torch.Tensor:
    return torch.arange(dim, dtype=torch.float32) + 10.0 * token


def value_of(token: int, dim: int) -> torch.Tensor:
    return -(torch.arange(dim, dtype=torch.float32) + 10.0 * token)


class StoreMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 5), pages=st.integers(0, 3))
    def setup(self, page_size: int, pages: int) -> None:
        self.store = PagedStore(
            len(HEADS), list(HEADS), list(KEY_DIMS), value_dim=list(VALUE_DIMS), page_size=page_size, pages_per_layer=pages
        )
        self.page_size = page_size
        self.model: dict[int, list[list[list[Token]]]] = {}  # seq -> layer -> head -> tokens
        self.logical: dict[int, list[int]] = {}
        self.next_token = 0

    # -- helpers -------------------------------------------------------------------------------

    def draw_batch(self, data: st.DataObject) -> list[int]:
        return data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))

    def append(self, layer: int, batch: list[int], steps: int, positions: list[list[int]] | None) -> None:
        heads, kd, vd = HEADS[layer], KEY_DIMS[layer], VALUE_DIMS[layer]
        keys = torch.zeros(len(batch), heads, steps, kd)
        values = torch.zeros(len(batch), heads, steps, vd)
        for b, seq in enumerate(batch):
            step_positions = positions[b] if positions else [self.logical[seq][layer] + t for t in range(steps)]
            for h in range(heads):
                for t in range(steps):
                    token = self.next_token
                    self.next_token += 1
                    keys[b, h, t] = key_of(token, kd)
                    values[b, h, t] = value_of(token, vd)
                    self.model[seq][layer][h].append((token, step_positions[t]))
            self.logical[seq][layer] += steps
        given = torch.tensor(positions, dtype=torch.int64) if positions else None
        self.store.append(layer, batch, keys, values, given)

    def check_read(self, layer: int, batch: list[int], read) -> None:
        kd, vd = KEY_DIMS[layer], VALUE_DIMS[layer]
        for b, seq in enumerate(batch):
            for h, tokens in enumerate(self.model[seq][layer]):
                n = len(tokens)
                assert bool(read.valid[b, h, :n].all()) and not bool(read.valid[b, h, n:].any())
                expect_k = torch.stack([key_of(t, kd) for t, _ in tokens]) if tokens else torch.zeros(0, kd)
                expect_v = torch.stack([value_of(t, vd) for t, _ in tokens]) if tokens else torch.zeros(0, vd)
                assert torch.equal(read.keys[b, h, :n], expect_k), (seq, layer, h)
                assert torch.equal(read.values[b, h, :n], expect_v), (seq, layer, h)
                assert read.positions[b, h, :n].tolist() == [p for _, p in tokens]
                assert bool((read.keys[b, h, n:] == 0).all()) and bool((read.positions[b, h, n:] == -1).all())

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.model) < 6)
    @rule()
    def new_sequence(self) -> None:
        seq = self.store.new_sequence()
        assert seq not in self.model
        self.model[seq] = [[[] for _ in range(h)] for h in HEADS]
        self.logical[seq] = [0] * len(HEADS)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), steps=st.integers(0, 12), explicit=st.booleans())
    def append_tokens(self, data: st.DataObject, layer: int, steps: int, explicit: bool) -> None:
        batch = self.draw_batch(data)
        positions = None
        if explicit:
            positions = [data.draw(st.lists(st.integers(0, 10_000), min_size=steps, max_size=steps)) for _ in batch]
        self.append(layer, batch, steps, positions)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), steps=st.integers(1, 4))
    def decode_loop(self, data: st.DataObject, layer: int, steps: int) -> None:
        """Append one token and read the same batch, repeatedly: the read cache's write-through path."""
        batch = self.draw_batch(data)
        self.check_read(layer, batch, self.store.read(layer, batch))
        for _ in range(steps):
            self.append(layer, batch, 1, None)
            self.check_read(layer, batch, self.store.read(layer, batch))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1))
    def compact(self, data: st.DataObject, layer: int) -> None:
        batch = self.draw_batch(data)
        per_head = []
        for seq in batch:
            for h in range(HEADS[layer]):
                n = len(self.model[seq][layer][h])
                kept = data.draw(st.lists(st.integers(0, max(n - 1, 0)), unique=True, max_size=n)) if n else []
                per_head.append(data.draw(st.permutations(kept)))
        width = max((len(k) for k in per_head), default=0) + data.draw(st.integers(0, 2))
        keep = torch.full((len(batch), HEADS[layer], width), -1, dtype=torch.int64)
        for i, kept in enumerate(per_head):
            b, h = divmod(i, HEADS[layer])
            keep[b, h, : len(kept)] = torch.tensor(kept, dtype=torch.int64)
            tokens = self.model[batch[b]][layer][h]
            self.model[batch[b]][layer][h] = [tokens[j] for j in sorted(kept)]
        self.store.compact(layer, batch, keep)

    @precondition(lambda self: self.model and len(self.model) < 6)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(sorted(self.model)))
        child = self.store.fork(source)
        assert child not in self.model
        self.model[child] = [[list(head) for head in layer] for layer in self.model[source]]
        self.logical[child] = list(self.logical[source])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        batch = self.draw_batch(data)
        self.store.release(batch)
        for seq in batch:
            del self.model[seq], self.logical[seq]

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def pages_are_accounted(self) -> None:
        live = torch.tensor(sorted(self.model), dtype=torch.int64)
        for pool, table in zip(self.store.pools, self.store.tables):
            references = torch.zeros(pool.capacity, dtype=torch.int64)
            if len(live):
                referenced = table.referenced_pages(live)
                references.index_add_(0, referenced, torch.ones_like(referenced))
            assert torch.equal(pool.refcount, references), "reference counts differ from table references"
            free = pool.free_page_ids()
            assert free.unique().numel() == free.numel(), "a page is on the free list twice"
            assert sorted(free.tolist()) == (references == 0).nonzero().flatten().tolist(), "leaked or lost page"
            assert pool.bytes_in_use() == int((references > 0).sum()) * pool.page_bytes
            if len(live):
                pages_used = table.pages_used(table.lengths[live])
                have = table.pages[live] >= 0
                expected = torch.arange(table.pages.shape[2]) < pages_used.unsqueeze(-1)
                assert torch.equal(have, expected), "block table holds pages past a head's length"

    @invariant()
    def sequences_read_back_their_tokens(self) -> None:
        for seq in self.model:
            for layer in range(len(HEADS)):
                rows = torch.tensor([seq])
                longest = max(len(h) for h in self.model[seq][layer])
                self.check_read(layer, [seq], self.store._gather(layer, rows, longest))
                assert self.store.logical_lengths(layer, [seq]).tolist() == [self.logical[seq][layer]]
                lengths = [len(h) for h in self.model[seq][layer]]
                assert self.store.physical_lengths(layer, [seq]).tolist() == [lengths]


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachine = StoreMachine.TestCase
