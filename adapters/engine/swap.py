"""Swapping a preempted sequence's keys and values out of the paged store and back.

:func:`swap_out` copies every layer of one sequence into host memory (pinned when the store is
on CUDA) and releases the sequence; :func:`swap_in` appends them to a new sequence, at the same
positions, each layer having seen as many tokens as before (a sliding-window layer holds only its
window's last tokens, so layers hold different counts). Only sequences whose heads hold the same
tokens (no per-head eviction) swap; others are recomputed instead (the engine decides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.devices import host_buffer
from kvlib.storage.store.paged_store import PagedStore


@dataclass
class SwappedSequence:
    """One sequence's layers in host memory: ``keys[layer]`` ``[1, kv_heads, held, head_dim]``
    (and values likewise), ``positions[layer]`` int64 ``[held]`` (every head holds the same
    tokens), ``held`` being what that layer held; ``seen``: tokens the sequence had seen (its
    logical length); ``tokens``: the most tokens a head of any layer held."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    seen: int
    tokens: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def swap_out(store: PagedStore, seq: int) -> SwappedSequence:
    """Copy ``seq``'s stored tokens to host memory and release it (its pages return to the pool)."""
    keys, values, positions = [], [], []
    seen = int(store.logical_lengths(0, [seq])[0])
    for layer in range(store.num_layers):
        held = int(store.physical_lengths(layer, [seq]).max())
        read = store.read(layer, [seq], mirror=False)
        for dense, saved in ((read.keys, keys), (read.values, values)):
            host = host_buffer((1, dense.shape[1], held, dense.shape[3]), dense.dtype, dense.device)
            host.copy_(dense[:, :, :held], non_blocking=True)
            saved.append(host)
        positions.append(read.positions[0, 0, :held].cpu())
    if store.device.type == "cuda":
        torch.cuda.current_stream(store.device).synchronize()  # host copies complete before the pages are reused
    store.release([seq])
    return SwappedSequence(keys, values, positions, seen, max(len(held) for held in positions))


def swap_in(store: PagedStore, swapped: SwappedSequence) -> int:
    """A new sequence holding the swapped tokens at their positions, having seen as many tokens
    as before in every layer; returns its id."""
    seq = store.new_sequence()
    try:
        for layer, (keys, values, positions) in enumerate(zip(swapped.keys, swapped.values, swapped.positions)):
            device = store.device
            store.append(layer, [seq], keys.to(device, non_blocking=True), values.to(device, non_blocking=True), positions)
            store.set_logical_length(layer, seq, swapped.seen)
    except Exception:
        store.release([seq])  # nothing half restored stays behind
        raise
    return seq
