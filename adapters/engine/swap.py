"""Swapping a preempted sequence's keys and values out of the paged store and back.

:func:`swap_out` copies every layer of one sequence into host memory (pinned when the store is
on CUDA) and releases the sequence; :func:`swap_in` appends them to a new sequence, at the same
positions. Only sequences whose heads hold the same tokens (no per-head eviction) swap; others
are recomputed instead (the engine decides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.devices import host_buffer
from kvlib.storage.store.paged_store import PagedStore


@dataclass
class SwappedSequence:
    """One sequence's layers in host memory: ``keys[layer]`` ``[1, kv_heads, tokens, head_dim]``
    (and values likewise); ``tokens``: how many tokens each head held."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def swap_out(store: PagedStore, seq: int) -> SwappedSequence:
    """Copy ``seq``'s stored tokens to host memory and release it (its pages return to the pool)."""
    keys, values = [], []
    tokens = int(store.physical_lengths(0, [seq]).max())
    for layer in range(store.num_layers):
        read = store.read(layer, [seq], mirror=False)
        for dense, saved in ((read.keys, keys), (read.values, values)):
            host = host_buffer((1, dense.shape[1], tokens, dense.shape[3]), dense.dtype, dense.device)
            host.copy_(dense[:, :, :tokens], non_blocking=True)
            saved.append(host)
    if store.device.type == "cuda":
        torch.cuda.current_stream(store.device).synchronize()  # host copies complete before the pages are reused
    store.release([seq])
    return SwappedSequence(keys, values, tokens)


def swap_in(store: PagedStore, swapped: SwappedSequence) -> int:
    """A new sequence holding the swapped tokens at positions ``0 .. tokens - 1``; returns its id."""
    seq = store.new_sequence()
    try:
        for layer, (keys, values) in enumerate(zip(swapped.keys, swapped.values)):
            store.append(layer, [seq], keys.to(store.device, non_blocking=True), values.to(store.device, non_blocking=True))
    except Exception:
        store.release([seq])  # nothing half restored stays behind
        raise
    return seq
