"""Block table of one layer: page ids per (sequence, KV head), stored and logical lengths.

All tensors are int64 on the CPU (bookkeeping never waits on the accelerator):

- ``pages[row, head, j]``: id of the ``j``-th page of that head, ``-1`` past the last page;
- ``lengths[row, head]``: physical length, tokens stored for that head;
- ``logical[row]``: logical length, tokens the sequence has seen in this layer;
- ``sealed[row, head]``: leading pages of that head known to be sealed (encoded by the layer's
  codec; always 0 in a store without codecs). Pages past it may be sealed too (a page shared
  with a sequence that sealed it); pages before it are.

Invariant: for every live ``(row, head)``, ``pages[row, head, j] >= 0`` exactly for
``j < ceil(lengths[row, head] / page_size)``. Rows of released sequences are all ``-1`` / 0.
Token ``i`` of a head (its ``i``-th stored token, in order) sits in page ``i // page_size`` at
offset ``i % page_size``.

``pages_np``, ``lengths_np``, ``logical_np`` and ``sealed_np`` are numpy views of the same
memory as ``pages``, ``lengths``, ``logical`` and ``sealed``: a planned decode step (:mod:`kvlib.storage.store.step_plan`) reads and
bumps them there, which costs no trip through torch's dispatcher.
"""

from __future__ import annotations

import numpy as np
import torch


class _NumpyMirrored:
    """A CPU tensor attribute kept with a numpy view of its memory under ``<name>_np``: assigning
    the tensor assigns both, so the two never point at different memory."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.mirror = name + "_np"

    def __get__(self, table: object | None, owner: type | None = None) -> torch.Tensor:
        return self if table is None else table.__dict__[self.name]

    def __set__(self, table: object, value: torch.Tensor) -> None:
        table.__dict__[self.name] = value
        table.__dict__[self.mirror] = value.numpy()


class BlockTable:
    """Per-layer block tables of all sequences of a store (one row per sequence id)."""

    pages = _NumpyMirrored()
    """int64 ``[rows, heads, max_pages]``: each head's page ids, ``-1`` past its last (``pages_np``: its numpy view)."""
    sealed = _NumpyMirrored()
    """int64 ``[rows, heads]``: leading pages of each head known to be sealed (``sealed_np``: its numpy view)."""
    lengths = _NumpyMirrored()
    """int64 ``[rows, heads]``: tokens stored per (row, head) (``lengths_np``: its numpy view)."""
    logical = _NumpyMirrored()
    """int64 ``[rows]``: tokens each row has seen (``logical_np``: its numpy view)."""
    pages_np: np.ndarray
    sealed_np: np.ndarray
    lengths_np: np.ndarray
    logical_np: np.ndarray

    def __init__(self, num_heads: int, page_size: int, rows: int = 1, max_pages: int = 1) -> None:
        self.page_size = page_size
        self.pages = torch.full((rows, num_heads, max_pages), -1, dtype=torch.int64)
        self.lengths = torch.zeros(rows, num_heads, dtype=torch.int64)
        self.logical = torch.zeros(rows, dtype=torch.int64)
        self.sealed = torch.zeros(rows, num_heads, dtype=torch.int64)

    def __getstate__(self) -> dict:
        """The tensors without their numpy views (a copy's views are made anew, of its own tensors)."""
        return {name: value for name, value in self.__dict__.items() if not name.endswith("_np")}

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, pickling): each tensor set through its descriptor, so that its
        numpy view names the copy's memory, not the original's."""
        for name, value in state.items():
            setattr(self, name, value)

    def advance(self, rows: np.ndarray, stored: np.ndarray | int, seen: int) -> None:
        """``rows`` (distinct) stored ``stored`` more tokens per head (an int, or int64 ``[len(rows),
        heads]``) and saw ``seen`` more: a planned decode step's bookkeeping."""
        self.lengths_np[rows] += stored
        self.logical_np[rows] += seen

    @property
    def num_heads(self) -> int:
        return self.pages.shape[1]

    def ensure_rows(self, rows: int) -> None:
        """Grow (doubling) so that row ids below ``rows`` exist."""
        have = self.pages.shape[0]
        if rows <= have:
            return
        new = max(rows, 2 * have)
        self.pages = _grow_dim(self.pages, 0, new, -1)
        self.lengths = _grow_dim(self.lengths, 0, new, 0)
        self.logical = _grow_dim(self.logical, 0, new, 0)
        self.sealed = _grow_dim(self.sealed, 0, new, 0)

    def ensure_pages(self, max_pages: int) -> None:
        """Grow (doubling) so that every head can hold ``max_pages`` pages."""
        have = self.pages.shape[2]
        if max_pages > have:
            self.pages = _grow_dim(self.pages, 2, max(max_pages, 2 * have), -1)

    def pages_used(self, lengths: torch.Tensor) -> torch.Tensor:
        """Pages needed to hold ``lengths`` tokens (elementwise ceil division)."""
        return (lengths + (self.page_size - 1)) // self.page_size  # one add: the constant folded first

    def flat_slots(self, rows: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """Arena slots (``page * page_size + offset``) of tokens ``token_index [B, H, T]`` of ``rows``.

        Indices must be below the table's page capacity. An index past a head's last page maps
        to a negative slot; callers mask such entries.
        """
        page_of = token_index // self.page_size
        page_ids = self.pages[rows].gather(2, page_of)
        return page_ids * self.page_size + token_index % self.page_size

    def referenced_pages(self, rows: torch.Tensor) -> torch.Tensor:
        """All page ids referenced by ``rows`` (with repeats), as a flat tensor."""
        pages = self.pages[rows]
        return pages[pages >= 0]

    def clear(self, rows: torch.Tensor) -> None:
        self.pages[rows] = -1
        self.lengths[rows] = 0
        self.logical[rows] = 0
        self.sealed[rows] = 0

    def copy_row(self, source: int, target: int) -> None:
        self.pages[target] = self.pages[source]
        self.lengths[target] = self.lengths[source]
        self.logical[target] = self.logical[source]
        self.sealed[target] = self.sealed[source]


def _grow_dim(tensor: torch.Tensor, dim: int, size: int, fill: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = size
    out = torch.full(shape, fill, dtype=tensor.dtype)
    out.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return out
