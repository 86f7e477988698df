"""A hand-made layer view with the attention of recent queries, for the decode-time policies' reference tests."""

from __future__ import annotations

import torch

from kvlib.policy import LayerView

BATCH, KV_HEADS, GROUPS, SLOTS, DIM = 2, 2, 3, 16, 4


def recent_view(window: int, seed: int = 0, layer: int = 0) -> LayerView:
    """Row 0: two slots of left padding. Row 1, head 1: gaps from an earlier eviction and three
    empty slots at the end. ``recent_attention`` is the softmax attention of ``window`` queries
    at each row's newest positions over the keys they see (causal), as the engine computes it."""
    generator = torch.Generator().manual_seed(seed)
    valid = torch.ones(BATCH, KV_HEADS, SLOTS, dtype=torch.bool)
    valid[0, :, :2] = False
    valid[1, 1, -3:] = False
    positions = torch.full((BATCH, KV_HEADS, SLOTS), -1, dtype=torch.int64)
    positions[0, :, 2:] = torch.arange(SLOTS - 2)
    positions[1, 0] = torch.arange(SLOTS)
    positions[1, 1, : SLOTS - 3] = torch.tensor([0, 2, 3, 5, 7] + list(range(SLOTS - 8, SLOTS)))
    keys = torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=generator)
    newest = positions.amax(dim=(1, 2))
    query_positions = newest.view(-1, 1) - torch.arange(window - 1, -1, -1).view(1, -1)
    logits = torch.randn(BATCH, KV_HEADS * GROUPS, window, SLOTS, generator=generator) * 2
    seen = valid.repeat_interleave(GROUPS, dim=1).unsqueeze(2) & (
        positions.repeat_interleave(GROUPS, dim=1).unsqueeze(2) <= query_positions.view(BATCH, 1, window, 1)
    )
    attention = torch.softmax(logits.masked_fill(~seen, -torch.inf), dim=-1).nan_to_num(0.0)
    return LayerView(layer, 4, keys, keys.clone(), positions, valid, recent_attention=attention, recent_query_positions=query_positions)


def newest_tokens(view: LayerView, b: int, h: int, count: int) -> set[int]:
    """Slots of head ``(b, h)`` holding its ``count`` newest valid positions."""
    held = [(int(view.positions[b, h, s]), s) for s in range(view.valid.shape[-1]) if view.valid[b, h, s]]
    return {s for _, s in sorted(held)[-count:]} if count else set()


def assert_ranks_like(scores: torch.Tensor, view: LayerView, protected: int, expected: dict[tuple[int, int, int], float]) -> None:
    """Each head's ``protected`` newest tokens rank above the rest, newest highest; the rest score
    ``expected`` (by ``(row, head, slot)``); invalid slots are ``-inf``."""
    batch, heads, slots = view.valid.shape
    for b in range(batch):
        for h in range(heads):
            window = newest_tokens(view, b, h, protected)
            others = [s for s in range(slots) if view.valid[b, h, s] and s not in window]
            for s in range(slots):
                if not view.valid[b, h, s]:
                    assert scores[b, h, s] == -torch.inf
            for s in others:
                assert abs(float(scores[b, h, s]) - expected[b, h, s]) <= 1e-5 * max(1.0, abs(expected[b, h, s])), (b, h, s)
            if others and window:
                assert min(float(scores[b, h, s]) for s in window) > max(float(scores[b, h, s]) for s in others)
            by_position = sorted(window, key=lambda s: int(view.positions[b, h, s]))
            assert [float(scores[b, h, s]) for s in by_position] == sorted(float(scores[b, h, s]) for s in by_position)
