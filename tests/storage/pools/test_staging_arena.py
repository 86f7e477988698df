"""The staging arena: its leading rows hold the device rows, it is rebuilt only when the device
rows grow or more pages must be staged than it has room for, and then the staging rows double."""

from __future__ import annotations

import torch

from kvlib.storage.pools.host_arena import MIN_HOST_PAGES
from kvlib.storage.pools.staging_arena import StagingArena


def test_the_arena_starts_with_the_device_rows_and_is_kept_while_it_fits() -> None:
    staging = StagingArena()
    keys, values = torch.randn(3, 4, 2), torch.randn(3, 4, 1)
    assert staging.rows(keys, values) == 0
    arena_keys, arena_values = staging.around(keys, values, 2)
    assert torch.equal(arena_keys[:3], keys) and torch.equal(arena_values[:3], values)
    keys, values = arena_keys[:3], arena_values[:3]  # the pool's device rows become views of the start
    assert staging.rows(keys, values) == MIN_HOST_PAGES
    again = staging.around(keys, values, MIN_HOST_PAGES)
    assert again[0].data_ptr() == arena_keys.data_ptr()  # fits: not rebuilt
    bigger = staging.around(keys, values, MIN_HOST_PAGES + 1)
    assert bigger[0].shape[0] == 3 + 2 * MIN_HOST_PAGES and torch.equal(bigger[0][:3], keys)


def test_device_rows_that_grew_are_copied_into_a_new_arena() -> None:
    staging = StagingArena()
    keys, values = torch.randn(2, 4, 2), torch.randn(2, 4, 2)
    arena_keys, _ = staging.around(keys, values, 1)
    grown_keys, grown_values = torch.randn(5, 4, 2), torch.randn(5, 4, 2)  # no longer the arena's start
    assert staging.rows(grown_keys, grown_values) == 0
    new_keys, new_values = staging.around(grown_keys, grown_values, 1)
    assert new_keys.data_ptr() != arena_keys.data_ptr() and torch.equal(new_keys[:5], grown_keys)
