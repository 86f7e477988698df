"""HeldContexts: an LRU of whole caches by bytes, handing out forks (property test against a plain
model of an LRU), and what it does with caches it drops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.storage.prefix.held_contexts import HeldContexts


class FakeCache:
    """A cache of ``size`` page bytes: forks are new objects of the same size; reset is counted."""

    def __init__(self, size: int, origin: FakeCache | None = None) -> None:
        self.size = size
        self.origin = origin or self
        self.resets = 0

    def fork(self) -> FakeCache:
        return FakeCache(self.size, self.origin)

    def reset(self) -> None:
        self.resets += 1

    def memory_report(self) -> dict:
        return {"by_component": {"pages": self.size}}


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(0, 100),
    operations=st.lists(st.tuples(st.sampled_from(["hold", "fork"]), st.integers(0, 5), st.integers(0, 60)), max_size=40),
)
def test_an_lru_of_caches_by_bytes(capacity, operations):
    held = HeldContexts(capacity)
    model: dict[bytes, int] = {}  # key -> size, least recently used first
    origins: dict[bytes, FakeCache] = {}
    for operation, index, size in operations:
        key = bytes([index])
        if operation == "hold":
            cache = FakeCache(size)
            kept = held.hold(key, cache)
            assert kept == (size <= capacity)
            if kept:
                model.pop(key, None)
                model[key] = size
                origins[key] = cache
                while sum(model.values()) > capacity:
                    model.pop(next(iter(model)))
        else:
            fork = held.fork(key)
            assert (fork is None) == (key not in model)
            if fork is not None:
                assert fork.origin is origins[key] and fork is not origins[key]
                model[key] = model.pop(key)  # most recently used now
        assert list(held._held) == list(model) and held.nbytes == sum(model.values()) <= capacity


def test_a_dropped_cache_is_reset_and_the_caller_s_cache_is_not_the_held_one():
    held = HeldContexts(10)
    first = FakeCache(6)
    assert held.hold(b"a", first)
    kept_a = held._held[b"a"][0]
    assert kept_a is not first and kept_a.origin is first
    assert held.hold(b"b", FakeCache(6))  # over the capacity: a goes
    assert b"a" not in held and kept_a.resets == 1 and first.resets == 0 and held.evictions == 1
    assert held.fork(b"a") is None and held.misses == 1 and held.fork(b"b") is not None and held.hits == 1
    with pytest.raises(ValueError, match="capacity_bytes must be an int >= 0"):
        HeldContexts(-1)
