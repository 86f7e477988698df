"""Stateful property test of the page pool and paged store against a plain Python model.

Random appends (varied batches, token counts, explicit or default positions; many one-token
steps, so that the append fast path into a batch's open pages runs between forks, compactions,
truncations and other batches' appends), compactions with random keep sets, truncations (valid or
not, with or without a read mirror of the batch), forks, writes to forked sequences, decode-style
append+read loops through the read cache, and releases. After every step: no page leaked or freed
twice, reference counts equal block-table references, ``bytes_in_use`` equals pages in use times
page bytes, a page shared before and after the step was not written, and every live sequence
reads back exactly its model: the tokens appended minus those compacted or truncated away, in
order, with their positions (so a write, compaction or truncation never changes what a sharing
sequence reads).

``CodedStoreMachine`` runs the same rules on a store whose pools encode sealed pages with a
lossless codec that is not the identity (it stores each page's tokens reversed and negated; drawn
with or without the ``rotated`` codec's per-head Hadamard rotation around it where a layer's dims
allow it exactly), plus a rule that seals: the same invariants must hold whatever mix of open and sealed pages the
operations meet, and sealed pages are full, never written, and counted at the codec's bytes. The
seal rule hands the store each slot's score (a function of its token) and the codec checks that
each page it encodes gets its own tokens' scores (the salience ``mixed`` spends bits by).

``TieredStoreMachine`` and ``SpillingStoreMachine`` draw a codec too: none, the reversing codec
(checked against the model as above), or a lossy quantization codec (int8, fp8, kivi, gear). With
a lossy codec every call also goes to a reference store holding the same pages untiered
(:class:`Lockstep`), and reads must equal the reference's exactly: sealed pages that moved
between device, host and disk, encoded, decode to the same values as those that never moved.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlib import PagedStore, StoreConfig
from kvlib.codec import Field, PageCodec, TensorCodec, layer_shapes
from kvlib.policies.quantization.hadamard import RotatedQuantizer, is_power_of_two
from kvlib.spec import parse_spec
from kvlib.storage.pools.formats.coded_format import CodedPages
from kvlib.storage.pools.formats.tiered_coded_format import TieredCodedPages
from kvlib.storage.pools.formats.tiered_format import TieredPages
from kvlib.storage.pools.page_pool import PagePool
from kvlib.storage.pools.page_prefetch import PagePrefetcher
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.storage.tiers.spill_store import SpillStore

HEADS = (2, 3)
KEY_DIMS = (4, 3)
VALUE_DIMS = (16, 1)
"""Layer 0's dims are powers of two that a Hadamard rotation maps exactly (by 1/2 and 1/4), so the
rotated codec can serve it losslessly; layer 1's cannot be rotated."""

Token = tuple[int, int]  # (token id, position)


def key_of(token: int, dim: int) -> torch.Tensor:
    return torch.arange(dim, dtype=torch.float32) + 10.0 * token


def value_of(token: int, dim: int) -> torch.Tensor:
    return -(torch.arange(dim, dtype=torch.float32) + 10.0 * token)


class ReversingCodec(TensorCodec):
    """Lossless, but not the identity: a page is stored with its tokens reversed and negated, in
    float64 (so reading a sealed page without decoding it would give wrong tokens), and marked
    with the head it was encoded for (checked on decode, as per-head codecs need)."""

    @property
    def fields(self) -> dict[str, Field]:
        return {"reversed": Field((self.shape.page_size, self.shape.dim), torch.float64), "marks": Field((1,), torch.int8, True)}

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"reversed": -block.flip(1).double(), "marks": (heads + 1).to(torch.int8).view(-1, 1)}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        """Checks that the page is decoded as the head it was encoded for (0 marks: never encoded)."""
        assert torch.equal(encoded["marks"].view(-1).long(), heads + 1), "a page decoded with the wrong head (or never encoded)"
        return (-encoded["reversed"].flip(1)).to(self.shape.dtype)


class SalienceCheckingCodec(PageCodec):
    """A page codec that reads salience (as ``mixed`` does): the seal rule scores each stored slot
    by its key's first channel (``10 * token``), so every sealed page must get exactly its own
    tokens' scores, whatever forks, compactions and truncations moved."""

    uses_salience = True

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor, salience: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        assert salience is not None and torch.equal(salience, keys[:, :, 0]), "a page was sealed with other tokens' scores"
        return super().encode(keys, values, heads, salience)


def coded_codecs(page_size: int, rotated: bool) -> list[PageCodec]:
    """Each layer's reversing codec; with ``rotated``, layers whose dims allow it rotate their
    pages first (the ``rotated`` codec's Hadamard rotation per head around the reversing codec:
    still lossless, and a page decoded with another head's signs would read wrong)."""
    codecs = []
    for i in range(len(HEADS)):
        key, value = layer_shapes(len(HEADS), HEADS[i], KEY_DIMS[i], VALUE_DIMS[i], page_size, torch.float32, torch.device("cpu"))[i]
        if rotated and is_power_of_two(key.dim) and is_power_of_two(value.dim):
            codecs.append(
                SalienceCheckingCodec(RotatedQuantizer(ReversingCodec(key), i, 0), RotatedQuantizer(ReversingCodec(value), i, 1), "rotated")
            )
        else:
            codecs.append(SalienceCheckingCodec(ReversingCodec(key), ReversingCodec(value), "reversing"))
    return codecs


LOSSY_CODECS = ("int8", "fp8", "kivi(bits=4, group=1)", "gear")
"""Quantization codecs a tiered machine may draw (besides none and the lossless reversing codec)."""


def quantization_codecs(spec: str, page_size: int) -> list[PageCodec]:
    """Each layer's codec of the quantization policy ``spec``."""
    shapes = [
        layer_shapes(len(HEADS), HEADS[i], KEY_DIMS[i], VALUE_DIMS[i], page_size, torch.float32, torch.device("cpu"))[i]
        for i in range(len(HEADS))
    ]
    return parse_spec(spec).quantization.layer_codecs(shapes)


class Lockstep:
    """A store under test whose every method call but placement's (``rank_pages``: no content
    changes) is made on a ``reference`` store too (the test's result is the first store's; its
    attributes are the first store's)."""

    def __init__(self, store: PagedStore, reference: PagedStore) -> None:
        self.store = store
        self.reference = reference

    def __getattr__(self, name: str):
        found = getattr(self.store, name)
        if not callable(found) or name == "rank_pages":
            return found

        def both(*args, **kwargs):
            result = found(*args, **kwargs)
            getattr(self.reference, name)(*args, **kwargs)
            return result

        return both


class StoreMachine(RuleBasedStateMachine):
    coded = False
    tiered = False
    summarized = False
    spilling = False
    codec_choices: tuple[str | None, ...] = (None,)
    """Codecs a tiered machine draws from (``"reversing"``: the lossless one; others: :data:`LOSSY_CODECS`)."""

    @initialize(page_size=st.integers(1, 5), pages=st.integers(0, 3), prefetch=st.booleans(), rotated=st.booleans(), data=st.data())
    def setup(self, page_size: int, pages: int, prefetch: bool, rotated: bool, data: st.DataObject) -> None:
        codec = data.draw(st.sampled_from(self.codec_choices))
        self.coded = self.coded or codec is not None
        self.lossy = codec in LOSSY_CODECS
        disk_tier = self.disk_tier()

        def config(tiered: bool) -> StoreConfig:
            return StoreConfig(
                len(HEADS),
                list(HEADS),
                list(KEY_DIMS),
                value_dim=list(VALUE_DIMS),
                page_size=page_size,
                pages_per_layer=pages,
                codecs=quantization_codecs(codec, page_size) if self.lossy else coded_codecs(page_size, rotated) if self.coded else None,
                device_pages=5 if tiered else None,
                key_summaries=self.summarized,
                **(disk_tier if tiered else {}),
            )

        self.store = PagedStore(
            config(self.tiered),
            spill=self.spill if disk_tier else None,
            prefetcher=PagePrefetcher(torch.device("cpu"), fetch_host=True) if self.tiered and prefetch else None,
        )
        if self.lossy:
            self.store = Lockstep(self.store, PagedStore(config(False)))
        self.page_size = page_size
        self.model: dict[int, list[list[list[Token]]]] = {}  # seq -> layer -> head -> tokens
        self.logical: dict[int, list[int]] = {}
        self.next_token = 0
        self.shared: dict[int, list[torch.Tensor]] = {}  # layer -> [page ids, keys, values, positions]
        self.last_append: tuple[int, list[int]] | None = None  # (layer, batch) of the last append

    def disk_tier(self) -> dict:
        """With ``spilling``: 3 host pages per layer and a disk tier behind them (``self.spill``, in a
        fresh directory); the config's part."""
        if not self.spilling:
            return {}
        self.directory = tempfile.mkdtemp(prefix="kvlib-spill-")
        self.spill = SpillStore(DiskTier(self.directory, capacity_bytes=1), capacity_bytes=1 << 26)
        return {"host_pages": 3, "disk_pages": 1000}

    def teardown(self) -> None:
        if self.spilling and hasattr(self, "spill"):
            self.spill.close()
            assert self.spill.keys() == [], "closing the store left spilled records"
            self.spill.disk.close()
            shutil.rmtree(self.directory)

    # -- helpers -------------------------------------------------------------------------------

    def last_batch(self) -> list[int] | None:
        """The batch of the last append while all of it is live (the one the fast path may serve)."""
        if self.last_append and all(seq in self.model for seq in self.last_append[1]):
            return list(self.last_append[1])
        return None

    def draw_batch(self, data: st.DataObject) -> list[int]:
        """Often the last appended batch (so operations land between fast-path appends), else any."""
        last = self.last_batch()
        if last and data.draw(st.booleans()):
            return last
        return data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))

    def layer_and_batch(self, data: st.DataObject, layer: int) -> tuple[int, list[int]]:
        """Often the layer and batch of the last append, else ``layer`` and a drawn batch."""
        last = self.last_batch()
        if last and data.draw(st.booleans()):
            return self.last_append[0], last
        return layer, self.draw_batch(data)

    def continue_last_batch(self) -> None:
        """One more token for the last appended batch (default positions), if it is live: decoding
        going on right after a fork, compaction, truncation or release."""
        last = self.last_batch()
        if last:
            self.append(self.last_append[0], last, 1, None)

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
        self.last_append = (layer, batch)

    def check_read(self, layer: int, batch: list[int], read) -> None:
        """``read`` holds the model's tokens of ``batch`` in ``layer``: their values (with a lossy
        codec, those the reference store reads instead), positions and validity."""
        kd, vd = KEY_DIMS[layer], VALUE_DIMS[layer]
        reference = None
        if self.lossy:
            twin = self.store.reference
            reference = twin._gather(layer, twin._rows(batch), read.keys.shape[2])
        for b, seq in enumerate(batch):
            for h, tokens in enumerate(self.model[seq][layer]):
                n = len(tokens)
                assert bool(read.valid[b, h, :n].all()) and not bool(read.valid[b, h, n:].any())
                expect_k = torch.stack([key_of(t, kd) for t, _ in tokens]) if tokens else torch.zeros(0, kd)
                expect_v = torch.stack([value_of(t, vd) for t, _ in tokens]) if tokens else torch.zeros(0, vd)
                if reference is not None:
                    expect_k, expect_v = reference.keys[b, h, :n], reference.values[b, h, :n]
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
    @rule(
        data=st.data(),
        layer=st.integers(0, len(HEADS) - 1),
        steps=st.one_of(st.integers(1, 2), st.integers(0, 12)),
        explicit=st.sampled_from([False, False, True]),
    )
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
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), steps=st.integers(1, 6))
    def one_token_steps(self, data: st.DataObject, layer: int, steps: int) -> None:
        """One-token appends with default positions and no reads (the fast path without a mirror)."""
        batch = self.draw_batch(data)
        for _ in range(steps):
            self.append(layer, batch, 1, None)

    @precondition(lambda self: self.last_batch())
    @rule(steps=st.integers(1, 3), reverse=st.sampled_from([False, False, True]))
    def append_to_the_last_batch(self, steps: int, reverse: bool) -> None:
        """The batch of the last append again (default positions): a fast-path candidate after
        whatever ran in between (fork, compaction, truncation, release, other layers); sometimes
        the same ids in reverse order, which is another batch."""
        layer, batch = self.last_append[0], self.last_batch()
        self.append(layer, batch[::-1] if reverse else batch, steps, None)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), mirror=st.booleans(), then_append=st.booleans())
    def truncate(self, data: st.DataObject, layer: int, mirror: bool, then_append: bool) -> None:
        layer, batch = self.layer_and_batch(data, layer)
        heads = [self.model[seq][layer][h] for seq in batch for h in range(HEADS[layer])]
        stored = sorted({p for tokens in heads for _, p in tokens})
        longest = max(self.logical[seq][layer] for seq in batch)
        lengths = st.integers(0, longest + 1)
        if stored:  # a stored position or one past it: cuts that often split heads with explicit positions
            lengths = st.one_of(lengths, st.sampled_from(stored), st.sampled_from(stored).map(lambda p: p + 1))
        length = data.draw(lengths)
        if mirror:
            self.check_read(layer, batch, self.store.read(layer, batch))
        kept = [[p < length for _, p in tokens] for tokens in heads]
        if not all(k == sorted(k, reverse=True) for k in kept):  # dropped tokens not a suffix of a head
            before = [
                (t.pages.clone(), t.lengths.clone(), t.logical.clone(), p.refcount.clone(), p.free_page_ids())
                for t, p in zip(self.store.tables, self.store.pools)
            ]
            with pytest.raises(ValueError, match="not a suffix"):
                self.store.truncate(layer, batch, length)
            after = [
                (t.pages.clone(), t.lengths.clone(), t.logical.clone(), p.refcount.clone(), p.free_page_ids())
                for t, p in zip(self.store.tables, self.store.pools)
            ]
            assert all(torch.equal(x, y) for a, b in zip(before, after) for x, y in zip(a, b))
            return
        self.store.truncate(layer, batch, length)
        for seq in batch:
            self.model[seq][layer] = [[t for t in tokens if t[1] < length] for tokens in self.model[seq][layer]]
            self.logical[seq][layer] = min(self.logical[seq][layer], length)
        if mirror:
            self.check_read(layer, batch, self.store.read(layer, batch))
        if then_append:
            self.continue_last_batch()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), reuse_slots=st.booleans(), then_append=st.booleans())
    def compact(self, data: st.DataObject, layer: int, reuse_slots: bool, then_append: bool) -> None:
        """Compact with random keep sets: often all but one or two tokens of a head (a decode
        step's eviction, where slot reuse moves a token into the hole), else any subset. The model
        follows the layout the store returns, which must keep exactly the tokens named (in order
        without ``reuse_slots``)."""
        layer, batch = self.layer_and_batch(data, layer)
        per_head = []
        for seq in batch:
            for h in range(HEADS[layer]):
                n = len(self.model[seq][layer][h])
                few_dropped = st.sets(st.integers(0, max(n - 1, 0)), max_size=2).map(
                    lambda gone, n=n: [i for i in range(n) if i not in gone]
                )
                any_subset = st.lists(st.integers(0, max(n - 1, 0)), unique=True, max_size=n)
                kept = data.draw(st.one_of(few_dropped, any_subset)) if n else []
                per_head.append(data.draw(st.permutations(kept)))
        width = max((len(k) for k in per_head), default=0) + data.draw(st.integers(0, 2))
        keep = torch.full((len(batch), HEADS[layer], width), -1, dtype=torch.int64)
        for i, kept in enumerate(per_head):
            b, h = divmod(i, HEADS[layer])
            keep[b, h, : len(kept)] = torch.tensor(kept, dtype=torch.int64)
        layout = self.store.compact(layer, batch, keep, reuse_slots=reuse_slots)
        for i, kept in enumerate(per_head):
            b, h = divmod(i, HEADS[layer])
            old_slots = [j for j in layout[b, h].tolist() if j >= 0]
            assert sorted(old_slots) == sorted(kept)
            if not reuse_slots:
                assert old_slots == sorted(kept)
            tokens = self.model[batch[b]][layer][h]
            self.model[batch[b]][layer][h] = [tokens[j] for j in old_slots]
        if then_append:
            self.continue_last_batch()

    @precondition(lambda self: self.model and len(self.model) < 6)
    @rule(data=st.data(), then_append=st.booleans())
    def fork(self, data: st.DataObject, then_append: bool) -> None:
        """Fork (often a sequence of the last appended batch); then, maybe, append one token to
        that batch again, as decoding goes on after a beam is split."""
        last = self.last_batch()
        source = data.draw(st.sampled_from(sorted(self.model) + (last or [])))
        child = self.store.fork(source)
        assert child not in self.model
        self.model[child] = [[list(head) for head in layer] for layer in self.model[source]]
        self.logical[child] = list(self.logical[source])
        if then_append:
            self.shared_pages_are_never_written()  # note the pages the fork shares: the append must not write them
            self.continue_last_batch()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), then_append=st.booleans())
    def seal(self, data: st.DataObject, layer: int, then_append: bool) -> None:
        """Seal a batch's full pages (a no-op without codecs); maybe go on appending."""
        layer, batch = self.layer_and_batch(data, layer)
        sealed = self.store.seal(layer, batch, lambda: self.store.read(layer, batch, mirror=False).keys[..., 0])
        if not self.coded:
            assert sealed == 0
        if then_append:
            self.continue_last_batch()

    @precondition(lambda self: self.tiered and self.model)
    @rule(data=st.data(), layer=st.integers(0, len(HEADS) - 1), seed=st.integers(0, 2**16), then_append=st.booleans())
    def rank(self, data: st.DataObject, layer: int, seed: int, then_append: bool) -> None:
        """Rank a batch's pages by random token scores (as ``score_aware`` does): the best-scored
        pages move onto the device, the others to the host and on to disk; maybe go on appending."""
        layer, batch = self.layer_and_batch(data, layer)
        lengths = self.store.physical_lengths(layer, batch)
        slots = max(int(lengths.max()), 1)
        scores = torch.rand(len(batch), HEADS[layer], slots, generator=torch.Generator().manual_seed(seed))
        self.store.rank_pages(layer, batch, scores)
        if then_append:
            self.continue_last_batch()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), reuse=st.booleans())
    def release(self, data: st.DataObject, reuse: bool) -> None:
        """Release a batch; maybe give a released id straight to a new sequence and go on
        decoding the last batch (live again if that id was in it)."""
        batch = self.draw_batch(data)
        self.store.release(batch)
        for seq in batch:
            del self.model[seq], self.logical[seq]
        if reuse:
            self.new_sequence()
            self.continue_last_batch()

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def pages_are_accounted(self) -> None:
        live = torch.tensor(sorted(self.model), dtype=torch.int64)
        for layer, (pool, table) in enumerate(zip(self.store.pools, self.store.tables)):
            references = torch.zeros(pool.capacity, dtype=torch.int64)
            if len(live):
                referenced = table.referenced_pages(live)
                references.index_add_(0, referenced, torch.ones_like(referenced))
            assert torch.equal(pool.refcount, references), "reference counts differ from table references"
            free = pool.free_page_ids()
            assert free.unique().numel() == free.numel(), "a page is on the free list twice"
            assert sorted(free.tolist()) == (references == 0).nonzero().flatten().tolist(), "leaked or lost page"
            in_use = int((references > 0).sum())
            if isinstance(pool.format, CodedPages):
                sealed = int(pool.sealed.sum())
                assert not bool(pool.sealed[references == 0].any()) and bool((pool.raw_row[references == 0] == -1).all())
                assert torch.equal(pool.raw_row[references > 0] >= 0, ~pool.sealed[references > 0]), "open xor sealed"
                coded = sealed * pool.codec.page_bytes() if sealed else 0
                state = pool.codec.state_bytes()  # per-layer state (the rotation's signs), held with or without pages
                expected = (in_use - sealed) * pool.kv_page_bytes + coded + in_use * pool.position_page_bytes + state
                assert pool.bytes_in_use() == expected
                if len(live):  # a sealed page is always full: it sits before each referencing head's last full page
                    pages = table.pages[live]
                    full = torch.arange(pages.shape[2]) < (table.lengths[live] // self.page_size).unsqueeze(-1)
                    sealed_here = torch.zeros_like(full)
                    sealed_here[pages >= 0] = pool.sealed[pages[pages >= 0]]
                    assert bool(full[sealed_here].all()), "a sealed page is not full"
            else:
                assert pool.bytes_in_use() == in_use * pool.page_bytes
            if isinstance(pool.format, TieredPages):  # every page in use in exactly one tier, within the budgets
                self.check_tiers(pool, references > 0, layer)
            if isinstance(pool.format, TieredCodedPages):  # sealed pages are the tier pool's pages, one each
                sealed = pool.sealed & (references > 0)
                assert torch.equal(pool.tier_page >= 0, sealed), "a page has a tier page exactly when it is sealed"
                if pool.tiers is not None:
                    held = pool.tier_page[sealed]
                    assert pool.tiers.pages_in_use == held.numel() and bool((pool.tiers.refcount[held] == 1).all())
                    self.check_tiers(pool.tiers, pool.tiers.refcount > 0, layer)
            if len(live):
                pages_used = table.pages_used(table.lengths[live])
                have = table.pages[live] >= 0
                expected = torch.arange(table.pages.shape[2]) < pages_used.unsqueeze(-1)
                assert torch.equal(have, expected), "block table holds pages past a head's length"

    def check_tiers(self, pool: PagePool, used: torch.Tensor, layer: int) -> None:
        """Every page of ``pool`` in ``used`` lies in exactly one tier, the tiers within their budgets,
        and records exist exactly for the pages on disk (of ``layer``)."""
        on_device, on_host, on_disk = pool.device_row >= 0, pool.host_row >= 0, pool.on_disk
        tiers = on_device.long() + on_host.long() + on_disk.long()
        assert bool((tiers[used] == 1).all()), "a page in use is not in exactly one tier"
        assert not bool(tiers[~used].any()), "a free page still holds a tier"
        assert int(on_device.sum()) == pool.pages_on_device <= pool.device_pages
        assert pool.host_pages is None or pool.pages_on_host <= pool.host_pages
        assert pool.pages_on_disk <= pool.disk_pages
        if pool.spill is not None:  # a record exists exactly for each page on disk
            recorded = sorted(int.from_bytes(key[-8:], "big") for key in self.spill.keys() if int.from_bytes(key[16:20], "big") == layer)
            assert recorded == on_disk.nonzero().flatten().tolist(), "spilled records differ from the pages on disk"
        rows = pool.device_row[on_device]
        assert rows.unique().numel() == rows.numel()

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
                positions = self.store.stored_positions(layer, [seq])
                assert positions.shape == (1, HEADS[layer], longest)
                assert positions[0].tolist() == [[p for _, p in h] + [-1] * (longest - len(h)) for h in self.model[seq][layer]]

    @invariant()
    def shared_pages_are_never_written(self) -> None:
        """A page referenced more than once before and after a step kept its contents (with a
        lossy codec: unless it was sealed in between, which changes what it reads)."""
        for layer, pool in enumerate(self.store.pools):
            shared = (pool.refcount > 1).nonzero().flatten()
            sealed = pool.sealed[shared] if self.lossy else torch.zeros_like(shared, dtype=torch.bool)
            contents = [shared, sealed, *pool.read_pages(shared), pool.positions[shared].clone()]
            if layer in self.shared:
                ids, was_sealed, *before = self.shared[layer]
                still = torch.isin(ids, shared)
                index = torch.searchsorted(shared, ids[still])  # ``shared`` is ascending
                kept = was_sealed[still] == sealed[index]
                for old, new in zip(before, contents[2:]):
                    assert torch.equal(old[still][kept], new[index][kept]), "a shared page was written"
            self.shared[layer] = contents


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachine = StoreMachine.TestCase


class CodedStoreMachine(StoreMachine):
    coded = True


CodedStoreMachine.TestCase.settings = StoreMachine.TestCase.settings
TestCodedStoreMachine = CodedStoreMachine.TestCase


class TieredStoreMachine(StoreMachine):
    """The same rules with at most 5 pages per layer on the device (moved 2 at a time): pages move to the host and
    back under every operation, and reads stay exact, with or without a prefetch of the next
    layer's host pages started by each read (whatever changes between it and the next read)."""

    tiered = True
    codec_choices = (None, "reversing", *LOSSY_CODECS)


TieredStoreMachine.TestCase.settings = StoreMachine.TestCase.settings
TestTieredStoreMachine = TieredStoreMachine.TestCase


class SpillingStoreMachine(StoreMachine):
    """The same rules with 5 device pages and 3 host pages per layer, the rest spilled to an lmdb
    disk tier: pages cross all three tiers under every operation, reads stay exact (with or
    without prefetch), and records exist exactly for the pages on disk (none left once the store
    closes)."""

    tiered = True
    spilling = True
    codec_choices = (None, "reversing", *LOSSY_CODECS)


SpillingStoreMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSpillingStoreMachine = SpillingStoreMachine.TestCase
