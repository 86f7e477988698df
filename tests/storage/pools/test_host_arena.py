"""The host arena: pages stored come back as they were, rows are reused once released, and
growing keeps every page held."""

from __future__ import annotations

import torch

from kvlib.storage.pools.host_arena import MIN_HOST_PAGES, HostArena

CPU = torch.device("cpu")


def pages(count: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.arange(first, first + count, dtype=torch.float32).view(-1, 1, 1).expand(count, 4, 3).clone()
    return keys, -keys[:, :, :2]


def test_pages_round_trip_and_rows_are_reused() -> None:
    arena = HostArena(4, 3, 2, torch.float32, CPU)
    rows = arena.store(*pages(3, 0))
    assert arena.held == 3 and arena.rows == MIN_HOST_PAGES
    keys, values = arena.load(rows.flip(0), CPU)
    assert torch.equal(keys[:, 0, 0], torch.tensor([2.0, 1.0, 0.0])) and torch.equal(values[:, 0, 0], -keys[:, 0, 0])
    arena.release(rows[:1])
    assert arena.held == 2 and arena.store(*pages(1, 7)).tolist() == rows[:1].tolist()


def test_growing_keeps_the_pages_held() -> None:
    arena = HostArena(4, 3, 2, torch.float32, CPU)
    first = arena.store(*pages(MIN_HOST_PAGES - 1, 0))
    more = arena.store(*pages(5, 100))  # two more rows than are free: the arenas double
    assert arena.rows == 2 * MIN_HOST_PAGES and arena.held == MIN_HOST_PAGES + 4
    keys, _ = arena.load(torch.cat([first, more]), CPU)
    assert keys[:, 0, 0].tolist() == list(range(MIN_HOST_PAGES - 1)) + list(range(100, 105))
