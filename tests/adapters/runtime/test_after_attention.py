"""The routines both adapters run around a layer's attention (adapters/runtime/after_attention.py):
eviction after it, room in a held ring before a decode call, a compaction the evictor's
per-slot state follows. Through ``generate`` they are checked by the cache's and the Engine's
eviction tests; here on a small store directly."""

from __future__ import annotations

import torch

from kvlib import PagedStore, StoreConfig
from kvlib.adapters.runtime.after_attention import Evicted, compact, drop_behind_window, evict, following, make_ring_room
from kvlib.adapters.runtime.evictor import Evictor
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.needs import AttentionInputs
from kvlib.policies.eviction.streaming_llm import StreamingLLM

HEADS, DIM = 2, 4


def filled_store(tokens: int) -> tuple[PagedStore, int]:
    """A one-layer store holding one sequence of ``tokens`` tokens at positions ``0 ..``."""
    store = PagedStore(StoreConfig(1, HEADS, DIM, page_size=4))
    seq = store.new_sequence()
    keys = torch.randn(1, HEADS, tokens, DIM, generator=torch.Generator().manual_seed(tokens))
    store.append(0, [seq], keys, keys.clone())
    return store, seq


class Recorder:
    """A stand-in evictor that records the layouts it is handed."""

    def __init__(self) -> None:
        self.layouts: list[tuple[int, torch.Tensor]] = []

    def compacted(self, layer: int, layout: torch.Tensor) -> None:
        self.layouts.append((layer, layout))


def test_compact_hands_the_evictor_the_stores_layout() -> None:
    store, seq = filled_store(6)
    recorder = Recorder()
    keep = torch.tensor([[[0, 3, 5], [1, -1, -1]]])
    layout = compact(store, recorder, 0, [seq], keep, reuse_slots=False)
    assert recorder.layouts == [(0, layout)]
    assert store.stored_positions(0, [seq]).tolist() == [[[0, 3, 5], [1, -1, -1]]]
    assert compact(store, None, 0, [seq], torch.tensor([[[0, -1, -1], [0, -1, -1]]]), reuse_slots=False) is not None


def evicted_prefill(tokens: int, budget: int) -> tuple[PagedStore, int, Evicted]:
    """A prefill of ``tokens`` tokens, then :func:`evict` under ``streaming_llm`` (2 sinks) within ``budget``."""
    store, seq = filled_store(tokens)
    step = LayerStep(None, 0, store.read(0, [seq]), 0, tokens, True)
    inputs = AttentionInputs(torch.randn(1, HEADS, tokens, DIM), None, None, None, None)
    evictor = Evictor(StreamingLLM(sinks=2), budget, 1)
    return store, seq, evict(evictor, store, [seq], step, inputs, torch.zeros(1, dtype=torch.int64), reuse_slots=False)


def test_evict_compacts_a_head_over_its_budget_and_scores_what_it_kept() -> None:
    store, seq, evicted = evicted_prefill(10, 5)
    assert evicted.layout is not None
    assert store.stored_positions(0, [seq]).tolist() == [[[0, 1, 7, 8, 9]] * HEADS]
    assert evicted.salience().shape == (1, HEADS, 5)


def test_evict_within_the_budget_keeps_every_token_and_scores_them_all() -> None:
    store, seq, evicted = evicted_prefill(6, 8)
    assert evicted.layout is None and store.physical_lengths(0, [seq]).tolist() == [[6, 6]]
    assert evicted.salience().shape == (1, HEADS, 6)


def test_ring_room_drops_the_oldest_tokens_past_the_sinks_before_a_call() -> None:
    store, seq = filled_store(8)
    evictor = Evictor(StreamingLLM(sinks=2), 8, 1)  # a held cap of 8, kept as a ring
    assert make_ring_room(evictor, store, 0, [seq], 2, reuse_slots=False)
    assert store.stored_positions(0, [seq]).tolist() == [[[0, 1, 4, 5, 6, 7]] * HEADS]
    assert not make_ring_room(evictor, store, 0, [seq], 2, reuse_slots=False)  # room for two now
    assert not make_ring_room(Evictor(StreamingLLM(sinks=2), 8, 1, slack=4), store, 0, [seq], 4, reuse_slots=False)


def test_salience_follows_a_later_compaction() -> None:
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    moved = following(lambda: scores, torch.tensor([[[3, 0, -1]]]))
    assert moved().tolist() == [[[4.0, 1.0, -torch.inf]]]
    assert following(None, torch.tensor([[[0]]])) is None


def test_a_sliding_window_drops_what_each_row_left_behind() -> None:
    """Each row keeps the ``window - 1`` positions before the one its next query takes (per-row
    ``seen``); a row within its window and a second call with nothing behind drop nothing."""
    store = PagedStore(StoreConfig(1, HEADS, DIM, page_size=4))
    seqs = [store.new_sequence(), store.new_sequence()]
    keys = torch.randn(2, HEADS, 9, DIM, generator=torch.Generator().manual_seed(0))
    store.append(0, seqs, keys, keys.clone())
    recorder = Recorder()
    seen = torch.tensor([9, 12])  # the second row has seen 3 tokens the store no longer holds
    layout = drop_behind_window(store, recorder, 0, seqs, 5, seen, reuse_slots=True)
    assert recorder.layouts == [(0, layout)]
    positions = store.stored_positions(0, seqs)
    assert [sorted(p for p in head if p >= 0) for head in positions[:, 0].tolist()] == [[5, 6, 7, 8], [8]]
    assert store.physical_lengths(0, seqs).tolist() == [[4, 4], [1, 1]]
    assert drop_behind_window(store, recorder, 0, seqs, 5, seen, reuse_slots=True) is None
    assert drop_behind_window(store, None, 0, seqs, 20, 12, reuse_slots=True) is None
