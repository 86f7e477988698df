"""A layer's work after its attention, written once for the drop-in cache and the Engine.

:func:`keep_up` is the one ordered routine both run after a layer's attention (a drop-in cache
layer, :class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer`; the Engine's packed batch,
:class:`~kvlib.adapters.engine.model_runner.ModelRunner`): a codec that learns observes the call,
the evictor drops tokens, a sliding window frees what it left behind, a tiering policy arranges
the layer's tokens, full pages seal, the device tier's page ranking is refreshed and the prompt's
pages are indexed for reuse. Each caller does each step its own way (:class:`LayerUpkeep`) and
leaves empty the steps it has no part in; the order is this module's.

Where the evictor meets the store:

After a layer's attention, :func:`evict` hands the evictor the layer as attention left it;
when a head is over its budget the store compacts the layer and the evictor's per-slot state
follows the layout (:func:`compact`, also what a caller that knows which slots it drops uses: a
sliding window). :class:`Evicted` says whether the slots moved and gives the layer's token salience for a codec
that reads it. Before a decode call under a cap held as a ring, :func:`make_ring_room` drops
each full head's oldest tokens past the ring's start, so the call attends over its cap at most
on every path (a planned step reuses those slots instead). After a sliding-window layer's
attention, :func:`drop_behind_window` frees what left each row's window. The evictor itself
never touches the store: it decides, these routines compact.

Invariant: after each routine here, the evictor's per-slot state (accumulated attention) is
aligned with the layer's stored slots again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from kvlib.adapters.runtime.evictor import Evictor
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.needs import AttentionInputs
from kvlib.adapters.runtime.slot_order import keep_all_but
from kvlib.selection import position_rank
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.paged_store import PagedStore

Salience = Callable[[], torch.Tensor]
"""Scores of a layer's slots, computed only when called: ``[batch, kv_heads, slots]``, slot order,
``-inf`` for a slot holding no token worth keeping."""


@dataclass(frozen=True)
class Evicted:
    """What :func:`evict` did to one layer: ``layout`` the store's compaction layout (new slot ``i``
    holds old slot ``layout[..., i]``, ``-1`` none), or None when every stored token stayed (the
    slots did not move); ``salience`` the policy's keep-scores of the layer's slots as they now
    stand."""

    layout: torch.Tensor | None
    salience: Salience


Call = TypeVar("Call", contravariant=True)


class LayerUpkeep(Protocol[Call]):
    """What runs after one layer's attention, step by step, for :func:`keep_up`; ``call``: the
    caller's record of the attention call (what it saw). A step a caller has no part in does
    nothing (returns None, ``[layer]`` or False)."""

    def layers_to_seal(self, call: Call) -> list[int]:
        """Let a codec that learns observe the call; the layers whose full pages seal now."""
        ...

    def evict(self, call: Call) -> Evicted | None:
        """Let the evictor drop tokens (:func:`evict`); None where no evictor ran."""
        ...

    def slide(self, call: Call) -> torch.Tensor | None:
        """Free what a sliding window left behind; the store's layout, or None where nothing moved."""
        ...

    def arrange(self, call: Call, stored: LayerRead | None) -> bool:
        """Put the layer's tokens in a tiering policy's slot order; whether the slots moved.
        ``stored``: the layer as it stands, or None where a compaction changed it since (read it)."""
        ...

    def seal(self, call: Call, layers: list[int], salience: Salience | None) -> None:
        """Seal the full pages of ``layers``, a codec that reads it given ``salience``."""
        ...

    def rank(self, call: Call, stored: LayerRead | None) -> None:
        """Re-rank the layer's pages for the device tier (``stored`` as for :meth:`arrange`)."""
        ...

    def index(self, call: Call) -> None:
        """Index the prompt's full pages for reuse (after the last layer)."""
        ...


def keep_up(upkeep: LayerUpkeep[Call], call: Call, stored: LayerRead | None) -> None:
    """Run a layer's after-attention work in its one order: a learning codec observes, the
    evictor evicts, the window slides, a tiering policy arranges, pages seal (with the
    salience the eviction left, following the slide's layout), pages are re-ranked, the prompt is
    indexed. ``stored``: the layer's stored tokens as attention read them, or None where it read
    none (attention over the pages); dropped once a step moves the slots."""
    sealing = upkeep.layers_to_seal(call)
    salience = None
    evicted = upkeep.evict(call)
    if evicted is not None:
        salience = evicted.salience
        if evicted.layout is not None:
            stored = None
    layout = upkeep.slide(call)
    if layout is not None:
        stored, salience = None, following(salience, layout)
    if upkeep.arrange(call, stored):
        stored, salience = None, None
    upkeep.seal(call, sealing, salience)
    upkeep.rank(call, stored)
    upkeep.index(call)


def evict(
    evictor: Evictor,
    store: PagedStore,
    rows: list[int],
    step: LayerStep,
    inputs: AttentionInputs,
    real_offsets: torch.Tensor,
    *,
    reuse_slots: bool,
) -> Evicted:
    """Let ``evictor`` drop tokens from layer ``step.layer_idx`` of the store's ``rows`` after the
    call's attention, and compact what it drops.

    ``step.read``: the layer's stored tokens after the call's append, dense; or, for a call that
    attended straight over the pages (``step.paged``), their positions only
    (:meth:`~kvlib.storage.store.paged_store.PagedStore.read_positions`): keys and values are then read
    here, into a transient copy, only when a compaction is due with a policy that scores with
    them. ``inputs``: what the attention saw; ``real_offsets [batch]``: each row's padding tokens
    before its first real one (on the store's device)."""
    layer = step.layer_idx
    stored = None if step.paged is None else functools.partial(store.read, layer, rows, mirror=False)
    compaction = evictor.compaction(step, inputs, real_offsets, stored)
    if compaction is None:
        return Evicted(None, functools.partial(evictor.scores, step, inputs, real_offsets, stored))
    layout = compact(store, evictor, layer, rows, compaction.keep, compaction.values, reuse_slots=reuse_slots)
    return Evicted(layout, functools.partial(compaction.salience_after, layout))


def make_ring_room(evictor: Evictor, store: PagedStore, layer: int, rows: list[int], tokens: int, *, reuse_slots: bool) -> bool:
    """Under a held cap kept as a ring (:meth:`Evictor.ring`), make room in ``layer`` of ``rows``
    for a call's ``tokens`` before they are stored, as a planned step does by reusing slots: each
    head that would then hold more than its cap first drops its oldest tokens past the ring's
    start (compacted away, the per-slot state following). Returns whether anything was dropped.
    The cache's layers and the Engine's decode rows call it on the paths that are not planned, so
    that every path keeps, and attends over, the same tokens."""
    batch, heads = len(rows), store.tables[layer].num_heads
    caps = evictor.ring_caps(layer, batch, heads)
    start = evictor.ring_start(batch, heads)
    if caps is None or bool((caps - start < tokens).any()):
        return False
    positions = store.stored_positions(layer, rows)
    stored = positions >= 0
    excess = torch.from_numpy(stored.sum(-1).numpy() + tokens - caps).clamp(min=0)
    if not bool(excess.any()):
        return False
    rank = position_rank(positions, stored)
    dropped = (rank >= start) & (rank < start + excess.unsqueeze(-1))
    evictor.compacted(layer, store.compact(layer, rows, keep_all_but(positions, dropped), reuse_slots=reuse_slots))
    return True


def drop_behind_window(
    store: PagedStore,
    evictor: Evictor | None,
    layer: int,
    rows: list[int],
    window: int,
    seen: int | torch.Tensor,
    *,
    reuse_slots: bool,
) -> torch.Tensor | None:
    """Free the stored tokens of ``layer`` of ``rows`` that no later query of a sliding window of
    ``window`` tokens attends to, once each row has seen ``seen`` tokens (an int for every row, or
    int64 ``[batch]`` per row): every token at a position ``<= seen - window`` (the next query, at
    position ``seen``, sees ``seen - window + 1`` onwards), so a row then holds at most its last
    ``window - 1`` tokens. The evictor's per-slot state follows. Returns the store's layout, or
    None where no row held anything behind its window."""
    positions = store.stored_positions(layer, rows)
    oldest_kept = torch.as_tensor(seen, dtype=torch.int64).view(-1, 1, 1) - window + 1
    behind = (positions >= 0) & (positions < oldest_kept)
    if not bool(behind.any()):
        return None
    return compact(store, evictor, layer, rows, keep_all_but(positions, behind), reuse_slots=reuse_slots)


def compact(
    store: PagedStore,
    evictor: Evictor | None,
    layer: int,
    rows: list[int],
    keep: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    reuse_slots: bool,
) -> torch.Tensor:
    """Keep only the ``keep`` slots of ``layer`` of ``rows`` (:meth:`PagedStore.compact`, ``values``
    the kept tokens' merged values or None), the evictor's per-slot state following; returns
    the layout."""
    layout = store.compact(layer, rows, keep, values, reuse_slots=reuse_slots)
    if evictor is not None:
        evictor.compacted(layer, layout)
    return layout


def following(salience: Salience | None, layout: torch.Tensor) -> Salience | None:
    """``salience`` after the store compacted the layer with ``layout`` (new slot ``i`` holds old
    slot ``layout[..., i]``; ``-1``: none, scored ``-inf``)."""
    if salience is None:
        return None
    return functools.partial(_gathered, salience, layout)


def _gathered(salience: Salience, layout: torch.Tensor) -> torch.Tensor:
    scores = salience()
    layout = layout.to(scores.device)
    return scores.gather(-1, layout.clamp(min=0)).masked_fill(layout < 0, -torch.inf)
