"""One cache's use of a :class:`~kvlib.storage.prefix.prefix_store.PrefixStore`: what it reused, what it indexed,
and giving both back when the cache is reset or garbage-collected.

Invariant: while a session is open, its cache's sequences live in the store's paged store and it
holds (acquired) every index entry it attached or inserted (not a block the index already held
on other pages: :meth:`PrefixStore.insert`); :meth:`PrefixSession.close` releases the sequences
and the entries exactly once. A cache dropped without ``reset()`` leaks nothing: its finalizer
hands the session to the PrefixStore, which closes it at its next use (not in the finalizer
itself, which may run inside any code, a ``torch.device`` context included).
"""

from __future__ import annotations

import weakref

import torch

from kvlib.storage.prefix.prefix_index import Entry
from kvlib.storage.prefix.prefix_store import PrefixStore
from kvlib.storage.store.paged_store import PagedStore


class PrefixSession:
    """Reuse state of one cache: its rows (the cache's own list, kept in step), the prompt's
    blocks per row, how many leading blocks are attached or indexed, and the entries held."""

    def __init__(self, reuse: PrefixStore, namespace: str, store: PagedStore, rows: list[int], blocks: list[list[list[int]]]) -> None:
        self.reuse = reuse
        self.namespace = namespace
        self.store = store
        self.rows = rows
        self.blocks = blocks
        self.done = 0
        """Leading prompt blocks of every row that are attached or indexed."""
        self.entries: list[Entry] = []
        self.finalizer: weakref.finalize | None = None
        """Hands the session to the store if the cache is dropped unclosed (detached on close)."""

    @classmethod
    def start(
        cls, owner: object, reuse: PrefixStore, namespace: str, store: PagedStore, rows: list[int], prompt: torch.Tensor | None, batch: int
    ) -> PrefixSession:
        """New sequences for ``batch`` rows, each holding the longest prefix of its row of
        ``prompt`` (int ``[batch, tokens]``) cached for every row (whole pages, never the prompt's
        last token; nothing without a prompt, and nothing is indexed then); the session closes
        when ``owner`` (the cache) is garbage-collected."""
        size = store.page_size
        tokens = prompt.tolist() if prompt is not None else [[] for _ in range(batch)]
        blocks = [[row[i * size : (i + 1) * size] for i in range(len(row) // size)] for row in tokens]
        usable = max(len(tokens[0]) - 1, 0) // size
        found = [reuse.lookup(namespace, row_blocks[:usable]) for row_blocks in blocks]
        common = min(len(entries) for entries in found)
        session = cls(reuse, namespace, store, rows, blocks)
        rows.extend(store.new_sequence() for _ in tokens)
        for seq, entries in zip(rows, found):
            reuse.attach(namespace, seq, entries[:common])
            session.entries.extend(entries[:common])
            reuse.release(entries[common:])  # found for this row, past what every row shares
        session.done = common
        session.finalizer = weakref.finalize(owner, reuse.defer_close, session)
        return session

    @property
    def reused_tokens(self) -> int:
        return self.done * self.store.page_size

    def index(self, seen: int) -> None:
        """Index the prompt's full blocks among the first ``seen`` tokens not yet indexed."""
        upto = min(seen // self.store.page_size, len(self.blocks[0]))
        if upto <= self.done or not self.rows:
            return
        for seq, blocks in zip(self.rows, self.blocks):
            self.entries.extend(self.reuse.insert(self.namespace, seq, blocks[:upto], self.done))
        self.done = upto

    def extend(self, tokens: torch.Tensor, seen: int) -> None:
        """Index the full pages of ``tokens`` (int ``[batch, n]``: what the rows hold, the prompt
        first, e.g. ``generate``'s output) among the first ``seen`` tokens stored."""
        size = self.store.page_size
        rows = tokens.tolist()
        if len(rows) != len(self.rows):
            raise ValueError(f"tokens has {len(rows)} rows; the cache holds {len(self.rows)}")
        for row, blocks in zip(rows, self.blocks):
            if [row[i * size : (i + 1) * size] for i in range(len(blocks))] != blocks:
                raise ValueError("tokens must start with the prompt the cache was primed with")
        self.blocks = [[row[i * size : (i + 1) * size] for i in range(len(row) // size)] for row in rows]
        self.index(seen)

    def close(self) -> None:
        """Release the sequences and the entries held (idempotent)."""
        if self.finalizer is not None:
            self.finalizer.detach()
            self.finalizer = None
        if self.rows:
            self.store.release(list(self.rows))
            self.rows.clear()
        if self.entries:
            entries, self.entries = self.entries, []
            self.reuse.release(entries)
