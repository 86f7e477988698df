"""Eviction after a layer's attention: which stored tokens each head keeps within its budget.

The spec's budget is a token count per (layer, head) on average, or a fraction of the prompt:

- ``int``: a cap held at all times (prefill, prefill chunks, decoding). After a layer call of
  several tokens (a prompt or a chunk) each head over its cap keeps its cap best-scored ones; a
  decode step (one new token) compacts a head only once it holds more than its cap + ``slack``
  real tokens, and checks only every ``interval``-th step. Peak memory of a chunked prefill is
  therefore cap + chunk tokens per head; while decoding, cap + ``slack``.
- ``float`` in (0, 1]: prompt compression. After each call with more than one new token (a
  prompt, or a chunk of one under chunked prefill) each head keeps ``ceil(budget * real tokens
  seen)``; decode steps keep every new token.

How the per-call budget splits over layers and heads is the allocation's job (a
:class:`~kvlib.policy.Budget`; uniform unless the spec or the eviction policy says
otherwise). Padding tokens (left padding of a batch) are never kept once a policy runs, so a
padded row holds what it would hold alone. Policies get exactly the extras they declare in
``needs``; for one that needs nothing, nothing beyond the scores is computed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.merge import merged_values
from kvlib.adapters.runtime.needs import AttentionInputs, accumulated_attention, fill_needs, history_after_call, padding_slots
from kvlib.adapters.runtime.query_history import QueryHistory
from kvlib.adapters.runtime.slot_order import along_slots, ascending, ordered_view, position_order, scores_in_slot_order, to_slots
from kvlib.policies.budget.uniform import Uniform
from kvlib.policy import Budget, BudgetRequest, Eviction, LayerView, Rope
from kvlib.selection import select_keep
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.step_plan import Ring

_STATEFUL_NEEDS = frozenset({"accumulated_attention", "recent_queries", "prompt_length", "call_notes"})
"""Needs whose state follows every call (see :meth:`Evictor.planned_work`)."""
_RECEIVED = frozenset({"accumulated_attention"})

RECEIVED_SLACK = 64
"""Slots the accumulated attention of a planned decode step is grown by past what the call needs
(:meth:`Evictor.received_state`): one allocation and copy every 64 steps, not one per step."""


class PlannedWork(enum.Enum):
    """What follows a planned decode step's attention in one layer (:meth:`Evictor.planned_work`)."""

    NONE = "none"
    """Nothing: no evictor, or one that neither scores nor evicts in this step."""
    ACCUMULATE = "accumulate"
    """The attention each stored token received is added up (by the planned attention's kernel
    itself, into :meth:`Evictor.received_state`); nothing is evicted."""
    GENERAL = "general"
    """The evictor's general after-attention work (scoring, evicting a page of slack)."""


@dataclass
class Compaction:
    """What a layer keeps: ``keep`` int64 ``[batch, heads, k]`` kept slots (slot indices, not
    positions), ascending, -1 last;
    ``values``: their new values when evicted tokens were merged in, else None;
    ``scores``: the policy's keep-scores of every slot before the compaction ``[batch, heads,
    slots]`` (what a codec that reads salience gets, see :meth:`salience_after`)."""

    keep: torch.Tensor
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    def salience_after(self, layout: torch.Tensor) -> torch.Tensor:
        """The scores of the slots after the store compacted with ``layout`` (new slot ``i`` holds
        old slot ``layout[..., i]``; ``-1``: none, scored ``-inf``)."""
        layout = layout.to(self.scores.device)
        return self.scores.gather(-1, layout.clamp(min=0)).masked_fill(layout < 0, -torch.inf)


@dataclass
class Evictor:
    """Applies ``policy`` within ``budget`` (see the module docstring for the budget forms).

    State: per layer, the attention each stored token has accumulated (only for policies that
    need ``accumulated_attention``), aligned with the layer's stored slots, and the layer's
    :class:`~kvlib.adapters.runtime.query_history.QueryHistory` (only for policies that need
    ``recent_queries`` or ``prompt_length``); the current model call's ``call_notes`` (cleared
    when a layer index not above the last one arrives); the cache keeps them in step with its rows and
    slots (:meth:`select_rows`, :meth:`reset`, :meth:`compacted`: the caller hands on the layout
    of every compaction it makes).

    Selection is by position, not slot: after a compaction that reused slots (slot order no
    longer position order), each head's best tokens are chosen among its slots sorted by
    position, and policies that are not ``order_free`` score a view in that order, so the kept
    set is the one an in-order store would keep.

    ``budget=None``: a scorer that never evicts (its state still follows every call); its
    :meth:`scores` decide a codec's token salience where the spec has no eviction policy.
    """

    policy: Eviction
    budget: int | float | None
    num_layers: int
    allocation: Budget = field(default_factory=Uniform)
    slack: int = 0
    interval: int = 1
    rope: Rope | None = None
    merge: bool = False
    output_projections: list[torch.Tensor] | None = None
    """Per layer, the attention output projection split by query head (filled by ``make_cache``
    for policies that need ``output_projection``)."""
    layer_heads: tuple[int, ...] = ()
    """Per layer, its KV heads (empty: every layer has the heads a call names)."""
    windows: tuple[int | None, ...] = ()
    """Per layer, its sliding window in tokens (None: it sees every position; empty: no layer
    slides). On a sliding layer eviction chooses among the tokens the window keeps: those the
    window frees after the call (positions ``<= seen - window``) are never candidates, so no budget
    is spent on them."""
    _accumulated: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _decode_steps: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _history: dict[int, QueryHistory] = field(default_factory=dict, init=False, repr=False)
    _call_notes: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _last_layer: int = field(default=-1, init=False, repr=False)
    _held_caps: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict, init=False, repr=False)
    _layer_limits: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict, init=False, repr=False)
    _ring: Ring | None = field(default=None, init=False, repr=False)

    # -- planned decode steps (kvlib.storage.store.step_plan) ----------------------------------------------------

    def ring(self, batch: int, heads: int) -> Ring | None:
        """The held cap as a ring of slots for a planned decode step of ``batch`` rows of ``heads``
        KV heads in every layer (the same object while the shape holds), or None where the cap is
        not held as one (:meth:`ring_caps`) or the layers differ in KV heads (no step is planned
        for them)."""
        if self._ring is not None and self._ring.caps.shape[1:] == (batch, heads):
            return self._ring
        if self.ring_start(batch, heads) is None or any(self._heads(layer, heads) != heads for layer in range(self.num_layers)):
            return None
        self._ring = Ring(np.stack([self._layer_caps(layer, batch, heads) for layer in range(self.num_layers)]), self.policy.ring_start())
        return self._ring

    def ring_caps(self, layer: int, batch: int, heads: int) -> np.ndarray | None:
        """int64 ``[batch, heads]``: the caps of ``layer``'s ``heads`` KV heads where the held cap is
        kept as a ring (:meth:`ring_start`), else None."""
        return None if self.ring_start(batch, heads) is None else self._layer_caps(layer, batch, heads)

    def ring_start(self, batch: int, heads: int) -> int | None:
        """The ring's start (a head's first tokens that are never replaced) where the held cap is
        kept as a ring, else None: the policy scores (no :meth:`~kvlib.policy.Eviction.ring_start`),
        the budget is not an int, a ``slack`` or ``interval`` asks for amortised eviction, evicted
        values are merged, the allocation splits by scores, or some layer's cap lies within the
        ring's start (no window to turn). ``heads``: the KV heads of every layer :attr:`layer_heads` leaves open."""
        start = self.policy.ring_start()
        if (
            start is None
            or not isinstance(self.budget, int)
            or self.slack
            or self.interval != 1
            or self.merge
            or self.allocation.needs_scores
        ):
            return None
        if any(bool((self._layer_caps(layer, batch, self._heads(layer, heads)) <= start).any()) for layer in range(self.num_layers)):
            return None
        return start

    def _heads(self, layer: int, heads: int) -> int:
        """``layer``'s KV heads (:attr:`layer_heads`), or ``heads`` where they are not given."""
        return self.layer_heads[layer] if self.layer_heads else heads

    def compacts_each_step(self, tokens: int) -> bool:
        """Whether a decode step of ``tokens`` tokens compacts every layer it runs on, unless the
        cap is a :meth:`ring`: a held cap with no slack checked at every step."""
        return isinstance(self.budget, int) and not self.slack and (tokens > 1 or self.interval == 1)

    def planned_work(self, layer: int, query_length: int, stored: np.ndarray) -> PlannedWork:
        """What follows the attention of a planned decode call of ``query_length`` real tokens
        (none of them padding) in ``layer``, after which its heads hold ``stored`` tokens (int64
        ``[batch, kv_heads]``): nothing (:meth:`compaction` would keep every token and add nothing
        to the evictor's state), the kernel's received attention added to the accumulated
        attention and nothing else (H2O-like policies: :meth:`received_state`), or the
        general path (:meth:`compaction`). Unless the general path, the call counts as one of the
        layer's decode steps (for ``interval``), as :meth:`compaction` counts it."""
        fused = self.policy.needs == _RECEIVED and type(self.policy).attention_received is Eviction.attention_received
        work = PlannedWork.ACCUMULATE if fused else PlannedWork.NONE
        if self.policy.needs & _STATEFUL_NEEDS and not fused:
            return PlannedWork.GENERAL
        if self.budget is None:
            return work
        if isinstance(self.budget, float):
            return work if query_length == 1 else PlannedWork.GENERAL
        if query_length != 1:
            return PlannedWork.GENERAL
        done = self._decode_steps.get(layer, 0) + 1
        if done % self.interval == 0:
            if self.allocation.needs_scores:  # the layer's total is fixed before the scores split it
                if bool((stored.sum(-1) > self._layer_limit(layer, *stored.shape)).any()):
                    return PlannedWork.GENERAL
            elif bool((stored > self._layer_caps(layer, *stored.shape) + self.slack).any()):
                return PlannedWork.GENERAL
        self._decode_steps[layer] = done
        return work

    def received_state(self, layer: int, batch: int, heads: int, slots: int, device: torch.device) -> torch.Tensor:
        """``layer``'s accumulated attention (float32 ``[batch, heads, width]``, ``width >= slots``)
        for a planned decode call's kernel to add the attention it received into, in place
        (:func:`kvlib.kernels.paged_ops.paged_decode`'s ``received``): what :meth:`compaction`
        adds for a policy that counts a call's weights as they are (``attention_received`` not
        overridden), with no operator of its own. It grows :data:`RECEIVED_SLACK` slots past what
        a call needs at a time (a copy every that many steps), and slots past a head's length stay 0."""
        state = self._accumulated.get(layer)
        if state is None or state.shape[-1] < slots:
            grown = torch.zeros(batch, heads, slots + RECEIVED_SLACK, dtype=torch.float32, device=device)
            if state is not None:
                grown[..., : state.shape[-1]] = state
            self._accumulated[layer] = state = grown
        return state

    def over_cap(self, layer: int, stored: np.ndarray) -> int:
        """Tokens ``layer``'s heads hold past their caps when they hold ``stored`` (int64 ``[batch,
        kv_heads]``): what the ``slack`` holds now (0 without an int budget)."""
        if not isinstance(self.budget, int):
            return 0
        if self.allocation.needs_scores:  # a layer's total is capped, not each head's
            return int(np.maximum(stored.sum(-1) - self.budget * stored.shape[1], 0).sum())
        return int(np.maximum(stored - self._layer_caps(layer, *stored.shape), 0).sum())

    def _layer_caps(self, layer: int, batch: int, heads: int) -> np.ndarray:
        """int64 ``[batch, heads]``: each head's cap in ``layer`` under the int budget, from an
        allocation that needs no scores (its caps depend on the budget, layer and shape only)."""
        key = (layer, batch, heads)
        caps = self._held_caps.get(key)
        if caps is None:
            tokens = torch.full((batch,), self.budget, dtype=torch.int64)
            request = BudgetRequest(layer, self.num_layers, tokens, torch.zeros(batch, heads, dtype=torch.int64))
            caps = self._held_caps[key] = self.allocation.caps(request).cpu().numpy()
        return caps

    def _layer_limit(self, layer: int, batch: int, heads: int) -> np.ndarray:
        """int64 ``[batch]``: the tokens ``layer``'s heads may hold together under the int budget
        before a score-based allocation splits it again (its ``layer_tokens``, which scores do not
        change, plus a ``slack`` per head), as :meth:`_caps_and_over` compares them."""
        key = (layer, batch, heads)
        limit = self._layer_limits.get(key)
        if limit is None:
            tokens = torch.full((batch,), self.budget, dtype=torch.int64)
            request = BudgetRequest(layer, self.num_layers, tokens, torch.zeros(batch, heads, dtype=torch.int64))
            limit = self._layer_limits[key] = self.allocation.layer_tokens(request).cpu().numpy() + self.slack * heads
        return limit

    def compaction(
        self, step: LayerStep, inputs: AttentionInputs, real_offsets: torch.Tensor, stored: Callable[[], LayerRead] | None = None
    ) -> Compaction | None:
        """What each head keeps after this layer call, or None if every stored token stays.

        ``real_offsets [batch]`` (on the store's device) is each row's count of padding tokens
        before its first real one: subtracted from stored positions, it gives the positions
        policies see. ``stored``: for a step whose ``read`` holds positions only (it attended
        over the pages), reads the layer's keys and values; called only when a compaction is due
        and :attr:`reads_kv`.
        """
        read, layer = step.read, step.layer_idx
        remembered = history_after_call(self.policy, self._history.get(layer), step, inputs, real_offsets)
        if remembered is not None:
            self._history[layer] = remembered
        if layer <= self._last_layer:  # layers run in order: a new model call begins
            self._call_notes.clear()
        self._last_layer = layer
        accumulated = None
        if "accumulated_attention" in self.policy.needs:
            previous, history = self._accumulated.get(layer), self._history.get(layer)
            accumulated = self._accumulated[layer] = accumulated_attention(self.policy, step, inputs, real_offsets, previous, history)
        if self.budget is None:
            return None
        tokens = self._tokens(step, real_offsets)
        if tokens is None and inputs.real_new is None:
            return None
        candidates = self._in_window(step, read, read.valid & ~padding_slots(step, inputs.real_new))
        counts = candidates.sum(-1)
        seen = step.query_offset + step.query_length - real_offsets.to(counts.device)
        request = None if tokens is None else BudgetRequest(step.layer_idx, self.num_layers, tokens, counts, seen=seen)
        caps, over = self._caps_and_over(request, counts, self.slack if step.query_length == 1 else 0)
        if not bool(over.any()) and bool((counts == self._in_window(step, read, read.valid).sum(-1)).all()):
            return None  # nothing over its cap, no padding to drop (what a window frees, its slide frees)
        if stored is not None and self.reads_kv:
            read = stored()
        order = position_order(read.positions, read.valid)  # None unless a compaction reused slots
        scores = self._score(step, read, candidates, inputs, real_offsets, accumulated, order, tokens)
        slot_scores = scores if order is None or self.policy.order_free else scores_in_slot_order(scores, order)
        ranked = candidates
        if order is not None:  # select in position order: ties break as they would in order
            ranked = along_slots(candidates, order)
            scores = along_slots(scores, order) if self.policy.order_free else scores
        if caps is None:  # a score-based allocation splits the layer once the scores are known
            request.scores, request.candidates = scores, ranked
            caps = self.allocation.caps(request).to(counts.device)
        keep = select_keep(scores, ranked, torch.where(over, caps, counts))
        keep = ascending((keep if order is None else to_slots(keep, order)).to(read.valid.device))
        values = merged_values(read.keys, read.values, candidates, keep) if self.merge else None
        return Compaction(keep, values, slot_scores)

    def _in_window(self, step: LayerStep, read: LayerRead, candidates: torch.Tensor) -> torch.Tensor:
        """``candidates`` less the tokens a sliding layer's window frees once this call ran
        (logical positions ``<= seen - window``, ``seen`` counting the call's tokens)."""
        window = self.windows[step.layer_idx] if self.windows else None
        if window is None:
            return candidates
        oldest_kept = step.query_offset + step.query_length - window + 1
        return candidates & (read.positions.to(candidates.device) >= oldest_kept)

    def scores(
        self, step: LayerStep, inputs: AttentionInputs, real_offsets: torch.Tensor, stored: Callable[[], LayerRead] | None = None
    ) -> torch.Tensor:
        """The policy's keep-scores ``[batch, heads, slots]`` of every stored slot of the layer
        (slot order; padding and invalid slots ``-inf``), for a call after which :meth:`compaction`
        changed nothing (its per-call state is then up to date: this adds nothing to it).
        Arguments as :meth:`compaction`'s."""
        read = step.read
        candidates = self._in_window(step, read, read.valid & ~padding_slots(step, inputs.real_new))
        if stored is not None and self.reads_kv:
            read = stored()
        order = position_order(read.positions, read.valid)
        accumulated = self._accumulated.get(step.layer_idx)
        if accumulated is not None and accumulated.shape[-1] > candidates.shape[-1]:  # planned steps' room to grow
            accumulated = accumulated[..., : candidates.shape[-1]]
        scores = self._score(step, read, candidates, inputs, real_offsets, accumulated, order)
        if order is not None and not self.policy.order_free:
            scores = scores_in_slot_order(scores, order)
        return scores.masked_fill(~candidates, -torch.inf)

    def _score(
        self,
        step: LayerStep,
        read: LayerRead,
        candidates: torch.Tensor,
        inputs: AttentionInputs,
        real_offsets: torch.Tensor,
        accumulated: torch.Tensor | None,
        order: torch.Tensor | None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The policy's scores of the ``candidates`` of ``read``: in slot order, or in position
        ``order`` for a policy that is not ``order_free`` when ``order`` is given. ``tokens``:
        the call's budget per head (see :meth:`_tokens`), None when it compacts nothing."""
        view = LayerView(
            layer_idx=step.layer_idx,
            num_layers=self.num_layers,
            keys=read.keys,
            values=read.values,
            positions=torch.where(candidates, read.positions - real_offsets.to(read.positions.device).view(-1, 1, 1), -1),
            valid=candidates,
            accumulated_attention=accumulated,
        )
        fill_needs(
            view,
            self.policy,
            step,
            inputs,
            real_offsets,
            tokens,
            history=self._history.get(step.layer_idx),
            rope=self.rope,
            output_projections=self.output_projections,
            call_notes=self._call_notes,
        )
        if order is not None and not self.policy.order_free:
            view = ordered_view(view, order)
        scores = self.policy.score(view)
        if not isinstance(scores, torch.Tensor) or scores.shape != candidates.shape:
            raise ValueError(
                f"{type(self.policy).__name__}.score must return a tensor of shape {list(candidates.shape)}, got"
                f" {getattr(scores, 'shape', type(scores).__name__)}"
            )
        return scores

    @property
    def reads_kv(self) -> bool:
        """Whether compactions need the layer's stored keys and values (the policy reads them,
        or evicted values are merged into kept ones), not only their positions."""
        return self.policy.reads_kv or self.merge

    # -- state kept in step with the cache's rows -----------------------------------------------

    def select_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` of the state becomes old row ``index[i]``."""
        for layer, state in self._accumulated.items():
            self._accumulated[layer] = state[index.to(state.device)]
        for layer, history in self._history.items():
            self._history[layer] = history.rows(index)

    def compacted(self, layer: int, layout: torch.Tensor) -> None:
        """The store compacted ``layer``: new slot ``i`` of each head holds what old slot
        ``layout[..., i]`` held (int64 ``[batch, heads, k]``, ``-1`` past the new length, as
        :meth:`~kvlib.storage.store.paged_store.PagedStore.compact` returns it); per-slot state follows."""
        state = self._accumulated.get(layer)
        if state is not None:
            layout = layout.to(state.device)
            self._accumulated[layer] = state.gather(-1, layout.clamp(min=0)) * (layout >= 0)

    def reset(self) -> None:
        """Forget all state (the cache starts a new batch)."""
        self._accumulated.clear()
        self._decode_steps.clear()
        self._history.clear()
        self._call_notes.clear()
        self._last_layer = -1
        self._ring = None

    # -- helpers --------------------------------------------------------------------------------

    def _tokens(self, step: LayerStep, real_offsets: torch.Tensor) -> torch.Tensor | None:
        """int64 ``[batch]``: this call's budget per head on average, or None if it compresses nothing."""
        batch = step.read.valid.shape[0]
        device = step.read.valid.device
        if isinstance(self.budget, float):
            if step.query_length == 1:
                return None
            seen = step.query_offset + step.query_length - real_offsets.to(device)
            return (seen.to(torch.float64) * self.budget).ceil().clamp(min=1).to(torch.int64)
        tokens = torch.full((batch,), self.budget, dtype=torch.int64, device=device)
        if step.query_length == 1:
            done = self._decode_steps.get(step.layer_idx, 0) + 1
            self._decode_steps[step.layer_idx] = done
            return None if done % self.interval else tokens
        return self.policy.prompt_tokens(tokens)

    def _caps_and_over(self, request: BudgetRequest | None, counts: torch.Tensor, slack: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Per-head caps (None until the scores are known, for score-based allocations) and bool
        ``[batch, heads]``: the heads to compact, those over their cap plus ``slack`` (all heads of
        a row, for score-based allocations). Without a request (a call that only drops padding)
        each head keeps all its candidates."""
        if request is None:
            return counts, torch.zeros_like(counts, dtype=torch.bool)
        if self.allocation.needs_scores:
            limit = self.allocation.layer_tokens(request).to(counts.device) + slack * counts.shape[1]
            return None, (counts.sum(-1) > limit).unsqueeze(-1).expand_as(counts)
        caps = self.allocation.caps(request).to(counts.device)
        return caps, counts > caps + slack
