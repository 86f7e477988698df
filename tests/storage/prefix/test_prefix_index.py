"""The prefix index under a hypothesis state machine (users, LRU, capacity, eviction callbacks),
and hash collisions: a forced equal hash never returns another prefix's entry."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlib.storage.prefix.prefix_index import PrefixIndex

NAMESPACE = b"test"


class IndexMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(0, 12))
    def setup(self, capacity: int) -> None:
        self.evicted: list[bytes] = []
        self.index = PrefixIndex(capacity, lambda entry: self.evicted.append(entry.key))
        self.held: list[list] = []  # what each holder acquired, for releasing

    @rule(prompt=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=1, max_size=4), size=st.integers(1, 3))
    def insert_chain(self, prompt: list[list[int]], size: int) -> None:
        """A holder computes a prompt: what is cached is reused (acquired), the rest inserted."""
        found = self.index.lookup(prompt, NAMESPACE)
        self.index.acquire(found)
        keys = self.index.keys(prompt, NAMESPACE)
        held = list(found)
        for block in range(len(found), len(prompt)):
            before = dict(self.index.entries)
            entry = self.index.insert(keys[block], keys[block - 1] if block else b"", prompt[block], object(), size)
            assert entry is not None
            if keys[block] in before:
                assert entry is before[keys[block]]
            held.append(entry)
        for entry in held:
            assert entry.users >= 1 and entry.key not in self.index.lru
        self.held.append(held)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_holder(self, data: st.DataObject) -> None:
        held = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.index.release(held)

    @rule(prompt=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=1, max_size=4))
    def lookup(self, prompt: list[list[int]]) -> None:
        found = self.index.lookup(prompt, NAMESPACE)
        assert [e.tokens for e in found] == [tuple(b) for b in prompt[: len(found)]]
        if found and found[-1].key in self.index.lru:  # touched: most recently used
            assert next(reversed(self.index.lru)) in {e.key for e in found}

    @invariant()
    def users_match_holders_and_lru(self) -> None:
        users: dict[int, int] = {}
        for held in self.held:
            for entry in held:
                users[id(entry)] = users.get(id(entry), 0) + 1
        for key, entry in self.index.entries.items():
            assert entry.users == users.get(id(entry), 0)
            assert (key in self.index.lru) == (entry.users == 0)
        assert set(self.index.lru) <= set(self.index.entries)

    @invariant()
    def bytes_and_capacity(self) -> None:
        index = self.index
        assert index.nbytes == sum(e.nbytes for e in index.entries.values())
        in_use = sum(e.nbytes for e in index.entries.values() if e.users)
        assert index.nbytes <= max(index.capacity_bytes, in_use)
        if index.nbytes > index.capacity_bytes:
            assert not index.lru  # only in-use entries keep it over capacity
        assert index.evictions == len(self.evicted)  # on_evict once per eviction
        assert not set(index.entries) & set(self.evicted[-1:]) or self.evicted[-1] in index.entries  # re-inserted keys only


IndexMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexMachine = IndexMachine.TestCase


def test_a_forced_hash_collision_is_a_miss_never_a_wrong_entry() -> None:
    index = PrefixIndex(100, lambda entry: None, hash_function=lambda parent, tokens, namespace: b"same")
    first = index.insert(b"same", b"", [1, 2], "pages of 1 2", 1)
    assert first is not None
    assert index.lookup([[3, 4]], NAMESPACE) == []  # same key, other tokens: rejected
    assert index.collisions == 1
    assert index.insert(b"same", b"", [3, 4], "pages of 3 4", 1) is None  # cannot overwrite: stays uncached
    assert index.lookup([[1, 2]], NAMESPACE) == [first]
    # the parent is checked too: the same tokens after another prefix are another block
    index.insert(b"child", b"other parent", [5, 6], "x", 1)
    index.hash_function = lambda parent, tokens, namespace: b"same" if not parent else b"child"
    assert index.lookup([[1, 2], [5, 6]], NAMESPACE) == [first]


def test_eviction_is_least_recently_used_first() -> None:
    evicted = []
    index = PrefixIndex(2, lambda entry: evicted.append(entry.tokens))
    keys = index.keys([[1], [2], [3]], NAMESPACE)
    entries = [index.insert(keys[i], keys[i - 1] if i else b"", [i + 1], None, 1) for i in range(2)]
    index.release(entries)
    index.lookup([[1]], NAMESPACE)  # touch block 1: block 2 is now the least recently used
    third = index.insert(b"k3", b"", [9], None, 1)  # over capacity: an unused entry goes
    assert evicted == [(2,)] and third.users == 1


def test_a_planned_eviction_takes_only_unused_entries_still_indexed() -> None:
    evicted = []
    index = PrefixIndex(10, lambda entry: evicted.append(entry.tokens))
    keys = index.keys([[1], [2], [3]], NAMESPACE)
    entries = [index.insert(keys[i], keys[i - 1] if i else b"", [i + 1], None, 1) for i in range(3)]
    index.release(entries[1:])
    index.evict([entries[2], entries[0], entries[2]])  # the held entry stays; an evicted one is not evicted twice
    assert evicted == [(3,)] and list(index.lru) == [keys[1]] and index.nbytes == 2


@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=8),
    st.integers(0, 8),
    st.integers(0, 8),
)
def test_keys_extend_the_known_keys_as_if_hashed_from_the_start(blocks, known, more) -> None:
    """A sequence's keys grow block by block: keys computed from ``known`` earlier keys equal the
    chain hashed from the start, and the known ones are not hashed again."""
    index = PrefixIndex(10, lambda entry: None)
    head = index.keys(blocks[:known], NAMESPACE)
    calls = []
    hash_function = index.hash_function
    index.hash_function = lambda parent, tokens, namespace: calls.append(tokens) or hash_function(parent, tokens, namespace)
    assert index.keys(blocks, NAMESPACE, head) == PrefixIndex(10, lambda entry: None).keys(blocks, NAMESPACE)
    assert calls == blocks[len(head) :]
    fewer = max(len(head) - more, 0)
    assert index.keys(blocks[:fewer], NAMESPACE, head) == head[:fewer]  # fewer blocks than known: a prefix of them
