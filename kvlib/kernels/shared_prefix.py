"""Shared-prefix attention over a decode batch's pages (Hydragen: Juravsky et al. 2024,
arXiv:2402.05099; FlashInfer's cascade attention and SGLang's are the same decomposition).

Rows of a batch whose block tables begin with the same full pages (the same page ids in every KV
head: a prefix cache attaches them by reference) read those pages once for all their queries,
instead of once per row: :func:`share_prefixes` splits a block table into *groups* (rows and the
full pages they all begin with) and each row's *suffix* (its pages after its group's), and
:func:`attend_shared` runs

- one partial attention over every group's shared pages, the queries of all its rows as one
  query block per KV head (``group rows x query heads of the KV head x queries`` rows against
  each key: matrix-matrix instead of one matrix-vector per row);
- one partial attention of every row over its suffix (a row in no group: its whole table);

each through the page source's own kernel (:meth:`~kvlib.kernels.pages.PageReader.attend_parts`:
the numba kernel on the CPU, Triton's on CUDA), each giving its float32 output and log-sum-exp,
and merges them exactly (:func:`merge_parts`): softmax over a union of disjoint token sets is
``(e^(l_a - m) o_a + e^(l_b - m) o_b) / (e^(l_a - m) + e^(l_b - m))`` with ``m = max(l_a, l_b)``,
so the result equals attention over the whole table to float32 rounding.

Grouping: rows are sorted by their page ids (lexicographically, page by page), so rows with a
common prefix are neighbours; the number of full pages two neighbours share in every head is
their *common prefix*. A group is a run of neighbours and shares the smallest common prefix in
the run; the partition into runs maximizes the page reads saved, ``sum (rows - 1) x pages``
(a run is split at its weakest link where the two halves save more than the whole; a single
level: rows sharing a system prompt whose subsets share more join the grouping that saves more,
and what the others share beyond it is read per row). Only full pages count: a prefix ending
mid-page shares its full pages, and the partly filled page lies in each row's suffix. A group of
more than :data:`MAX_GROUP_ROWS` rows attends in near-equal parts of at most that many (each part
reads the shared pages once). Groups of similar size attend together: their rows are padded to a
power of two per call (at most twice the rows), one call per width.

Visibility: causal by the queries' positions, and every shared page precedes every row's queries
(its tokens were stored before them), so a group's queries see all of its shared tokens.

Invariant: for every row, the tokens of its group's shared pages and of its suffix are exactly
the tokens its block table names, each once; :meth:`PrefixSharing.tokens_read` counts the
(token, KV head) reads of the split, against ``lengths.sum()`` for the whole tables.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvlib.devices import to_arena_device
from kvlib.kernels.host_arrays import host_array
from kvlib.kernels.pages import PageReader

MIN_SAVED_READS = 32768
"""The fewest (token, KV head) reads per layer a split must save to be used: below it the split's
own work (grouping, a second and third kernel call, the merge: 0.3-0.5 ms per layer on this
project's 2-core CPU) costs more than the reads it saves (the break-even measured there by
``benchmarks/shared_prefix_bench.py``, about 30k reads). Unmeasured on CUDA."""

MAX_GROUP_ROWS = 16
"""The most rows whose queries attend over shared pages together (a Triton program holds them, times
the GQA group, as one tile of query rows); a larger group is cut into near-equal parts, each
reading the shared pages once."""


class SharedPages(NamedTuple):
    """Groups of one width (rows per group, padded) that attend over their shared pages in one call.

    ``pages`` int64 ``[groups, kv_heads, max_shared]`` (each group's shared pages, ``-1`` past
    them) and ``lengths`` int64 ``[groups, kv_heads]`` (its shared tokens: full pages times the
    page size); ``members`` int64 ``[groups, width]``: the batch rows of each group, padded by
    repeating its first row (padding queries run, and their results are never read)."""

    pages: torch.Tensor
    lengths: torch.Tensor
    members: torch.Tensor


class PrefixSharing(NamedTuple):
    """A decode batch's block table split into shared prefixes and each row's own suffix.

    ``groups``: the groups' shared pages, one :class:`SharedPages` per width; ``place`` int64
    ``[batch]``: each row's index among the groups' query rows laid end to end (group by group,
    ``width`` rows each, in the order of ``groups``), or their total for a row in no group;
    ``suffix_pages`` int64 ``[batch, kv_heads, max_pages]`` and ``suffix_lengths`` int64 ``[batch,
    kv_heads]``: each row's pages after its group's shared ones (every page for a row in no
    group), ``-1`` past the last. Every tensor on the CPU."""

    groups: list[SharedPages]
    place: torch.Tensor
    suffix_pages: torch.Tensor
    suffix_lengths: torch.Tensor
    runs: list[tuple[np.ndarray, int]]
    """The grouping: each group's batch rows (int64) and the full pages they share."""

    def tokens_read(self) -> int:
        """(token, KV head) pairs the split attention reads: every group's shared tokens once (once
        per part of a group cut in parts), and every row's suffix."""
        shared = sum(int(group.lengths.sum()) for group in self.groups)
        return shared + int(self.suffix_lengths.sum())

    @property
    def shared_rows(self) -> int:
        """Rows that read their prefix through a group."""
        return int((self.place < sum(group.members.numel() for group in self.groups)).sum())


def share_prefixes(
    pages: torch.Tensor, lengths: torch.Tensor, page_size: int, like: PrefixSharing | None = None, min_saved: int = 0
) -> PrefixSharing | None:
    """The split of a block table (``pages`` int64 ``[batch, kv_heads, max_pages]``, ``-1`` past
    each head's last page; ``lengths`` int64 ``[batch, kv_heads]`` tokens per head; both on the
    CPU) into groups of rows sharing their first full pages and each row's suffix (see the module
    docstring), or None where no two rows share a full page or the split saves fewer than
    ``min_saved`` (token, KV head) reads (:data:`MIN_SAVED_READS` is the Engine's default). ``like``: the split of another table
    of the same rows (another layer's): its groups are kept where every group's rows still begin
    with the same full pages here (checked), which spares the sort."""
    table = host_array(pages)
    held = host_array(lengths)
    batch, _, width = table.shape
    if batch < 2 or width == 0:
        return None
    full = np.minimum(held.min(axis=1) // page_size, width)  # full pages every head of a row holds
    runs = like.runs if like is not None and _runs_hold(like.runs, table, full) else _grouping(table, full)
    if not runs or _saved_reads(runs, page_size, table.shape[1]) < max(min_saved, 1):
        return None
    skip = np.zeros(batch, dtype=np.int64)
    by_width: dict[int, list[tuple[np.ndarray, int]]] = {}
    for rows, shared in runs:
        skip[rows] = shared
        for part in np.array_split(rows, -(-len(rows) // MAX_GROUP_ROWS)):
            by_width.setdefault(_padded_width(len(part)), []).append((part, shared))
    place = np.full(batch, sum(width * len(members) for width, members in by_width.items()), dtype=np.int64)
    groups, start = [], 0
    for group_width, members in sorted(by_width.items()):
        groups.append(_shared_pages(table, members, group_width, page_size))
        for index, (rows, _) in enumerate(members):
            place[rows] = start + index * group_width + np.arange(len(rows))
        start += group_width * len(members)
    suffix_pages, suffix_lengths = _suffixes(table, held, skip, page_size)
    return PrefixSharing(groups, torch.from_numpy(place), suffix_pages, suffix_lengths, runs)


def _saved_reads(runs: list[tuple[np.ndarray, int]], page_size: int, kv_heads: int) -> int:
    """(token, KV head) reads the split of ``runs`` saves against whole tables: each part of a
    group (at most :data:`MAX_GROUP_ROWS` rows) reads its shared pages once instead of once per row."""
    saved = 0
    for rows, shared in runs:
        parts = -(-len(rows) // MAX_GROUP_ROWS)
        saved += (len(rows) - parts) * shared
    return saved * page_size * kv_heads


def _grouping(table: np.ndarray, full: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """The groups of a block table's rows (module docstring): each group's rows and the full pages
    they share; empty where no two rows begin with the same full page."""
    batch, heads, _ = table.shape
    first = table[full > 0, 0, 0]
    if np.unique(first).size == first.size:  # no two rows begin with the same page: nothing shared
        return []
    longest = int(full.max())
    order = np.lexsort(table[:, :, :longest].transpose(2, 1, 0).reshape(longest * heads, batch)[::-1])
    ranked = table[order, :, :longest]
    same = (ranked[1:] == ranked[:-1]).all(axis=1)  # [batch - 1, longest]: page j the same in every head
    same &= np.arange(longest) < np.minimum(full[order][1:], full[order][:-1])[:, None]
    common = np.cumprod(same, axis=1).sum(axis=1)  # full pages each neighbour pair shares
    return [(order[start : end + 1], shared) for start, end, shared in _runs(common, 0, batch - 1)]


def _runs_hold(runs: list[tuple[np.ndarray, int]], table: np.ndarray, full: np.ndarray) -> bool:
    """Whether every group's rows hold at least its shared pages, full, with the same ids in every head."""
    return all(
        bool((full[rows] >= shared).all()) and bool((table[rows, :, :shared] == table[rows[0], :, :shared]).all()) for rows, shared in runs
    )


def _runs(common: np.ndarray, first: int, last: int) -> list[tuple[int, int, int]]:
    """The groups among sorted rows ``first .. last`` (``common[i]``: full pages rows ``i`` and
    ``i + 1`` share) that save the most page reads: ``(first row, last row, shared pages)`` each;
    the whole run shares its weakest link, and is split there where its halves save more."""
    if first >= last:
        return []
    weakest = first + int(np.argmin(common[first:last]))
    shared = int(common[weakest])
    halves = _runs(common, first, weakest) + _runs(common, weakest + 1, last)
    saved = sum((end - start) * pages for start, end, pages in halves)
    if shared == 0 or saved > (last - first) * shared:
        return halves
    return [(first, last, shared)]


def _padded_width(rows: int) -> int:
    """Rows a group is padded to in its call: the next power of two."""
    return 1 << (rows - 1).bit_length()


def _shared_pages(table: np.ndarray, members: list[tuple[np.ndarray, int]], width: int, page_size: int) -> SharedPages:
    """The :class:`SharedPages` of ``members`` (each group's rows and shared page count), padded to ``width`` rows."""
    heads = table.shape[1]
    most = max(shared for _, shared in members)
    pages = np.full((len(members), heads, most), -1, dtype=np.int64)
    lengths = np.zeros((len(members), heads), dtype=np.int64)
    rows = np.empty((len(members), width), dtype=np.int64)
    for index, (group, shared) in enumerate(members):
        pages[index, :, :shared] = table[group[0], :, :shared]
        lengths[index] = shared * page_size
        rows[index] = group[0]
        rows[index, : len(group)] = group
    return SharedPages(torch.from_numpy(pages), torch.from_numpy(lengths), torch.from_numpy(rows))


def _suffixes(table: np.ndarray, held: np.ndarray, skip: np.ndarray, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table after its first ``skip`` pages, and the tokens it holds there."""
    batch, heads, width = table.shape
    lengths = held - skip[:, None] * page_size
    used = max(1, int(-(-lengths.max() // page_size)))
    index = skip[:, None] + np.arange(used)  # [batch, used]
    padded = np.concatenate([table, np.full((batch, heads, used), -1, dtype=np.int64)], axis=2)
    pages = np.take_along_axis(padded, np.broadcast_to(index[:, None, :], (batch, heads, used)), axis=2)
    return torch.from_numpy(np.ascontiguousarray(pages)), torch.from_numpy(np.ascontiguousarray(lengths))


def attend_shared(
    source: PageReader,
    query: torch.Tensor,
    sharing: PrefixSharing,
    *,
    query_positions: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``query [batch, query_heads, queries, head_dim]`` over the pages ``sharing``
    splits, through ``source``'s kernel: what ``source.attend(query, pages, lengths,
    visible=None, query_positions=query_positions, ...)`` gives over the whole tables (causal
    by ``query_positions``, int64 ``[queries]``), to float32 rounding. Returns ``[batch,
    query_heads, queries, value_dim]`` in ``query``'s dtype, on the pages' device."""
    batch, heads, queries, dim = query.shape
    options = {"visible": None, "scale": scale, "softcap": softcap}
    outputs, sums = [], []
    by_row = query.transpose(1, 2)  # [batch, queries, heads, dim]
    latest = query_positions.amax()
    for group in sharing.groups:
        count, width = group.members.shape
        members = to_arena_device(group.members, query.device).reshape(-1)
        block = by_row[members].view(count, width, queries, heads, dim).permute(0, 3, 1, 2, 4).reshape(count, heads, width * queries, dim)
        out, lse = source.attend_parts(block, group.pages, group.lengths, query_positions=latest.repeat(width * queries), **options)
        outputs.append(out.reshape(count, heads, width, queries, -1).transpose(1, 2).reshape(count * width, heads, queries, -1))
        sums.append(lse.reshape(count, heads, width, queries).transpose(1, 2).reshape(count * width, heads, queries))
    suffix, suffix_lse = source.attend_parts(
        query, sharing.suffix_pages, sharing.suffix_lengths, query_positions=query_positions, **options
    )
    outputs.append(torch.zeros_like(suffix[:1]))  # the row of rows in no group: nothing seen
    sums.append(torch.full_like(suffix_lse[:1], float("-inf")))
    place = to_arena_device(sharing.place, suffix.device)
    prefix, prefix_lse = torch.cat(outputs)[place], torch.cat(sums)[place]
    return merge_parts(prefix, prefix_lse, suffix, suffix_lse).to(query.dtype)


def merge_parts(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint token sets from attention over each: outputs
    ``[..., value_dim]`` (float32) and log-sum-exps ``[...]`` (``-inf``: the set is empty to that
    query); float32, zeros where both are empty."""
    best = torch.maximum(lse_a, lse_b)
    shift = best.masked_fill(best == float("-inf"), 0.0)
    weight_a, weight_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = weight_a + weight_b
    inverse = torch.where(total > 0, total.reciprocal(), 0.0)
    return (out_a * (weight_a * inverse).unsqueeze(-1)) + (out_b * (weight_b * inverse).unsqueeze(-1))
