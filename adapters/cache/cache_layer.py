"""``KVCacheLayer``: one layer of a :class:`~kvlib.adapters.KVCache`, owning that layer's state and work.

A layer keeps what is its own: the tokens it has seen (its logical length), whether every stored
token still sits at the slot equal to its position (``identity``), the step it published and
whose attention has not yet run (``pending``) and the attention input a policy needing
``hidden_states`` asked for. It does its own work, in three parts:

- **storing a call** (:meth:`~KVCacheLayer.update`): the call's keys and values appended (or,
  in a planned decode step, written where the plan says) and a
  :class:`~kvlib.adapters.runtime.layer_step.LayerStep` published for the call's attention;
- **attention** (:meth:`~KVCacheLayer.attend`, the one place that chooses the path): over the
  pages a ``quest``-like query chooses (a sparse step), through the decode step's plan, straight
  over the layer's pages (a few new tokens: the paged kernel, the model's mask looked up at each
  stored token's position, so padding, sliding windows and chunked masks hold), or over a dense
  read with the model's mask moved onto the stored slots; each path returns what the work after
  it needs (:class:`~kvlib.adapters.runtime.needs.AttentionInputs`);
- **after attention** (:meth:`~KVCacheLayer.after_attention`, called once per call, by the layer
  itself): the ordered routine :func:`~kvlib.adapters.runtime.after_attention.keep_up`, which
  the Engine runs too, with this layer's steps: a learning codec observes the first call, the
  evictor evicts, a sliding window frees what no query will attend to again
  (``<= seen - window``, as ``DynamicCache``'s sliding layers keep ``window - 1`` tokens), a
  tiering policy arranges the layer's tokens, full pages seal (a codec that reads salience given
  the evictor's scores, computed only if a page seals), the device tier's ranking is refreshed,
  and after the last layer the prompt's pages are indexed in the prefix session.

What layers share (the paged store, the batch rows and their padding, the evictor, codecs,
tiering and prefix session) is the cache's (:class:`~kvlib.adapters.cache.shared_state.SharedState`);
the rows are store sequences spanning every layer, so selecting rows (beams) is the cache's too.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlib.adapters.cache.compiled_calls import traced_update
from kvlib.adapters.cache.shared_state import PrefillRecorder, SharedState
from kvlib.adapters.runtime import layer_step
from kvlib.adapters.runtime.after_attention import Evicted, Salience, drop_behind_window, evict, keep_up, make_ring_room
from kvlib.adapters.runtime.evictor import PlannedWork
from kvlib.adapters.runtime.layer_step import AttentionCall, AttentionPath, LayerStep, ReturnedTokens
from kvlib.adapters.runtime.masks import allowed, move_position_bias, physical_mask, real_new_tokens
from kvlib.adapters.runtime.needs import AttentionInputs
from kvlib.adapters.runtime.slot_order import ascending
from kvlib.codec import FitSample
from kvlib.devices import host_readable, reads_pages_in_place
from kvlib.kernels.pages import PagedLayer
from kvlib.policy import LayerView
from kvlib.storage.layers.read_cache import LayerRead

Attended = tuple[LayerStep, AttentionInputs]
"""One call as the work after its attention sees it: the step attended, and what its attention saw."""

PAGED_QUERY_TOKENS = 16
"""Calls with at most this many new tokens attend straight over the pages (see
:meth:`KVCacheLayer._paged_layer`); longer ones (prefill, chunks) read the layer into a transient
dense copy for SDPA."""


NOT_THROUGH_KVLIB = (
    "layer {layer}'s attention did not run through kvlib, so it attended over what the cache handed it (the new tokens"
    " only) and its eviction or codec cannot run: call kvlib.attach(model) (make_cache does) and keep attn_implementation"
    " on kvlib_sdpa / kvlib_eager"
)


class KVCacheLayer(CacheLayerMixin):
    """One layer of a :class:`~kvlib.adapters.KVCache` (see the module docstring).

    Invariant: ``seen`` is the layer's logical length (tokens seen, padding included, as
    ``DynamicCache`` counts them); ``pending`` is the step published by the last ``update``
    until its attention's after-attention work ran."""

    is_sliding = False

    def __init__(self, cache: SharedState, layer_idx: int, module_layer: int | None) -> None:
        self.keys = self.values = None
        self.cache = cache
        self.layer_idx = layer_idx
        self.module_layer = module_layer
        """The ``layer_idx`` of the attention module whose calls this layer serves (``layer_idx``
        numbers the KV layers, which skip a hybrid model's recurrent layers)."""
        self.seen = 0
        self.identity = True
        self.pending: LayerStep | None = None
        self.hidden_states: torch.Tensor | None = None
        self.recorder: PrefillRecorder | None = None  # a shared prefill's source records its after-attention inputs
        self.checked = False
        """Whether a call of this layer was checked against what the model's attention is handed
        (:meth:`_check_call`); until then its calls return every stored token."""

    @property
    def is_initialized(self) -> bool:
        return bool(self.cache.rows)

    @property
    def is_compileable(self) -> bool:
        """The cache's ``compileable`` (inside a compiled forward, a layer call is two operators:
        :mod:`~kvlib.adapters.cache.compiled_calls`; this says whether ``generate`` compiles by itself)."""
        return self.cache.compileable

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` rolls back exactly: no eviction, and no token left a sliding window
        (the tokens a rolled-back window needs again are gone)."""
        window = self.window
        return self.cache.evictor is None and (window is None or self.seen < window)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache builds its store (at construction, or before it hands the layer its first call)."""

    # -- one layer call -------------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the call's new keys and values (``[batch, kv_heads, tokens, dim]``, the cache's
        rows started) and publish the step for this call's attention (in ``kwargs``, the layer
        call's attention keyword arguments, when given: transformers 5.24+). Returns what
        attention runs over: the layer's stored tokens (dense), or just the new ones where
        attention needs no dense read of the layer (:meth:`_new_tokens_step`). Inside a forward
        being compiled, the work is one operator (:mod:`~kvlib.adapters.cache.compiled_calls`)."""
        if torch.compiler.is_compiling():
            return traced_update(
                self.cache, self.layer_idx, key_states, value_states, self.cache.shape.layer_value_dims[self.layer_idx], kwargs
            )
        step = self.store_call(key_states, value_states)
        self.pending = step
        layer_step.publish(step, kwargs)
        if step.complete:
            layer_step.remember_returned(step)
        return step.read.keys, step.read.values

    def store_call(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerStep:
        """:meth:`update`'s work: store the call's keys and values; returns the step for the
        call's attention (not published)."""
        cache = self.cache
        offset, tokens = self.seen, key_states.shape[2]
        if self.layer_idx == 0:
            if not cache.prepared:  # no forward pre-hook planned this call (kvlib.attach adds one)
                cache.prepare_step(tokens, mask_known=False)
            cache.prepared = False
        planned = cache.planned
        if (
            planned is not None and planned.plan.tokens == tokens
        ):  # a decode step planned for every layer: one write, attention over the pages
            previous = cache.kv_layers[self.layer_idx - 1]
            if previous.pending is not None:
                raise RuntimeError(NOT_THROUGH_KVLIB.format(layer=previous.layer_idx))
            plan = planned.plan
            plan.pools[self.layer_idx].format.write_planned(plan, self.layer_idx, key_states, value_states)
            self.seen += tokens
            self.identity = self.identity and isinstance(plan.stored, int)  # a ring reuses slots
            new_tokens = LayerRead(key_states, value_states, None, None)
            return LayerStep(self, self.layer_idx, new_tokens, offset, tokens, self.identity, plan=plan)
        cache.start_call(self.layer_idx, key_states)
        store = cache.store
        if cache.recompute is not None:
            return self._overwrite(key_states, value_states)
        first_tokens = self._holds_nothing(key_states)
        if not first_tokens:
            self._ring_room(tokens)
        store.append(self.layer_idx, cache.rows, key_states, value_states)
        self.seen += tokens
        tiering = cache.tiering
        if tiering is not None and tiering.retrieves_pages and self.returns_new_tokens and tiering.sparse(self.layer_idx, tokens):
            return self._new_tokens_step(key_states, value_states, offset, sparse=True)
        if first_tokens:  # the layer holds exactly this call's tokens: attention runs over them as given
            return self._new_tokens_step(key_states, value_states, offset, identity=self.identity)
        if (paged := self._paged_layer(tokens)) is not None:
            return self._new_tokens_step(key_states, value_states, offset, paged=paged)
        return LayerStep(self, self.layer_idx, store.read(self.layer_idx, cache.rows), offset, tokens, self.identity)

    def _ring_room(self, tokens: int) -> None:
        """Under a held cap kept as a ring, make room for a decode call's ``tokens`` before they are
        stored (:func:`~kvlib.adapters.runtime.after_attention.make_ring_room`), so the call attends
        over the cap at most, whichever path it takes."""
        cache = self.cache
        if cache.evictor is not None and tokens <= PAGED_QUERY_TOKENS:
            if make_ring_room(cache.evictor, cache.store, self.layer_idx, cache.rows, tokens, reuse_slots=cache.reuse_slots):
                self.identity = False

    def _new_tokens_step(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        offset: int,
        *,
        sparse: bool = False,
        paged: PagedLayer | None = None,
        identity: bool = False,
    ) -> LayerStep:
        """The step of a call whose attention needs no dense read of the layer: a decode step of
        a page-retrieval policy (``sparse``, ``quest``: the pages its query chooses,
        :meth:`read_chosen_pages`), a few tokens attending straight over the layer's pages
        (``paged``), or the first tokens of a layer that held none (a prefill: the layer is
        these tokens, at slots equal to their positions when ``identity``). Its read holds the
        new tokens, at positions ``offset ..``."""
        batch, heads, tokens = key_states.shape[:3]
        positions = (offset + torch.arange(tokens, device=key_states.device)).expand(batch, heads, tokens).contiguous()
        valid = torch.ones(batch, heads, tokens, dtype=torch.bool, device=key_states.device)
        new_tokens = LayerRead(key_states, value_states, positions, valid)
        return LayerStep(self, self.layer_idx, new_tokens, offset, tokens, identity, sparse=sparse, paged=paged)

    def _holds_nothing(self, key_states: torch.Tensor) -> bool:
        """Whether this layer holds no token of the batch yet (no prefix attached either) and the
        store keeps ``key_states``' dtype, so that after the append it reads back exactly the
        call's own tensors (pools encode pages only once sealed, after attention)."""
        store = self.cache.store
        return (
            self.seen == 0 and key_states.dtype == store.dtype and not bool(store.physical_lengths(self.layer_idx, self.cache.rows).any())
        )

    def _paged_layer(self, query_length: int) -> PagedLayer | None:
        """The layer's pages for attention straight over them (no dense copy; with tiering only
        the off-device pages are staged), when this call may use them: at most
        :data:`PAGED_QUERY_TOKENS` new tokens (decoding, assisted decoding's candidates; under
        eviction the evictor then reads what it needs itself, see :meth:`_stored_layer`), no
        read mirror asked for, a device the kernel runs on and a pool that gives its pages; else None."""
        store = self.cache.store
        if (
            not self.returns_new_tokens
            or self.cache.read_cache
            or query_length > PAGED_QUERY_TOKENS
            or not reads_pages_in_place(store.device)
        ):
            return None
        return store.paged_layer(self.layer_idx, self.cache.rows)

    def _overwrite(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerStep:
        """:meth:`store_call` inside :meth:`KVCache.recomputing`: the call's tokens are stored ones, rewritten."""
        store, rows, positions = self.cache.store, self.cache.rows, self.cache.recompute
        store.overwrite(self.layer_idx, rows, positions, key_states, value_states)
        read = store.read(self.layer_idx, rows)
        return LayerStep(self, self.layer_idx, read, self.seen, key_states.shape[2], False, positions.to(read.positions.device))

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append precomputed ``keys`` and ``values`` (``[batch, kv_heads, tokens, dim]``) as the
        layer's first tokens, at positions ``0 .. tokens - 1``."""
        self.cache.store.append(self.layer_idx, self.cache.rows, keys, values)
        self.seen = keys.shape[2]

    # -- attention ------------------------------------------------------------------------------

    def attend(self, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention of ``call`` over ``step``'s tokens (:meth:`_attention` chooses the path),
        then :meth:`after_attention`, once.

        The step is first checked against what the model hands attention (:meth:`_check_call`):
        the keys and values ``update`` returned, and a mask over logical positions."""
        step.attended = True
        self._check_call(step, call)
        output, weights, attended = self._attention(step, call)
        self.after_attention(*attended)
        return output, weights

    def _attention(self, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None, Attended]:
        """The one choice of this layer's attention path for ``call``: over the pages the query
        chooses (a sparse step), through the decode step's plan, straight over the layer's pages
        (with SDPA and plain attention; else over a transient dense read), or over the step's
        dense read, the model's mask moved onto the stored slots once tokens were dropped.
        Returns the output (``[batch, queries, query_heads, value_dim]``), the weights (or None)
        and the call as the work after it sees it (the step attended, what the attention saw)."""
        if step.sparse:
            return self._sparse_attention(step, call)
        key, value = call.key, call.value
        path = call.path(planned=step.plan is not None, over_pages=step.paged is not None)
        if path is AttentionPath.PLANNED:
            return self._planned_attention(step, call)
        if path is AttentionPath.OVER_PAGES:
            return self._attention_over_pages(step, call.query, call.attention_mask, call.kwargs)
        if step.plan is not None or step.paged is not None:
            step = self.dense_step(step)
            key, value = step.read.keys, step.read.values
        mask = call.attention_mask
        if not step.identity:
            mask = physical_mask(mask, step, call.query.shape[1], call.float_mask_dtype)
            move_position_bias(call.kwargs, step, call.query.shape[1])
        output, weights = call.run_inner(key, value, mask)
        real_new = real_new_tokens(call.attention_mask, step) if step.query_positions is None else None
        return output, weights, (step, AttentionInputs(call.query, mask, weights, call.kwargs.get("scaling"), real_new))

    def _attention_over_pages(
        self, step: LayerStep, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict
    ) -> tuple[torch.Tensor, None, Attended]:
        """SDPA's output for ``query`` (``[batch, query_heads, queries, head_dim]``) over the pages
        of ``step`` (``step.paged``), as ``transformers``' SDPA attention gives it over the dense
        layer: the model's mask over logical positions is looked up at each stored token's position,
        ``scaling`` is the module's, grouped-query heads share their KV head's pages."""
        batch, _, queries, head_dim = query.shape
        if attention_mask is None:  # SDPA's causal shortcut: causal in the logical positions
            visible, query_positions = None, step.query_offset + torch.arange(queries)
        else:
            visible, query_positions = allowed(attention_mask)[:, 0].expand(batch, -1, -1), None
        scale = kwargs.get("scaling") or head_dim**-0.5
        output = step.paged.attend(query, visible=visible, query_positions=query_positions, scale=scale)
        inputs = AttentionInputs(query, attention_mask, None, scale, real_new_tokens(attention_mask, step))
        return output.transpose(1, 2).contiguous(), None, (step, inputs)

    def _planned_attention(self, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, None, Attended]:
        """A planned step's attention straight over the layer's pages (the store's paged kernel
        through the plan), the attention each stored token received added by the kernel itself into
        the evictor's accumulated attention where it adds it up (:attr:`PlannedWork.ACCUMULATE`:
        no operator of its own); the real new tokens are found once per step, at layer 0
        (:attr:`PlannedDecode.real_new <kvlib.adapters.cache.planned_decode.PlannedDecode.real_new>`)."""
        cache, layer_idx, query, mask, plan = self.cache, self.layer_idx, call.query, call.attention_mask, step.plan
        planned = cache.planned
        scale = call.kwargs.get("scaling") or query.shape[-1] ** -0.5
        received = None
        if planned.work[layer_idx] is PlannedWork.ACCUMULATE:
            slots = int(cache.store.tables[layer_idx].lengths_np[plan.rows_np].max())
            received = cache.evictor.received_state(layer_idx, *plan.lengths.shape[1:], slots, plan.lengths.device)
        output = plan.pools[layer_idx].format.attend_planned(plan, layer_idx, query, mask, scale, received=received)
        if layer_idx == 0 and not planned.known_real:
            real_new = real_new_tokens(mask, step)
            if real_new is not None and not host_readable(real_new):  # counted on the device, not looked at: no sync
                cache.padding += (~real_new).sum(-1)
            elif real_new is not None and not bool(real_new.all()):
                planned.real_new = real_new
        return output, None, (step, AttentionInputs(query, mask, None, scale, planned.real_new))

    def _sparse_attention(self, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None, Attended]:
        """A sparse decode step's attention (``quest``): ``update`` stored the new token but read
        nothing back, since the pages worth attending over depend on the query. Over the pages
        :meth:`choose_pages` picks for ``call.query [batch, query_heads, 1, head_dim]``, where they
        lie (the page kernel with a block table restricted to them, :meth:`_attention_over_pages`);
        where the kernel does not apply (eager attention, attention sinks, a pool or device that
        cannot read pages in place), over a dense copy of them, the model's mask moved onto their
        slots, through the inner attention. Either way the result equals full attention
        restricted to the chosen pages' tokens."""
        query, attention_mask = call.query, call.attention_mask
        selection = self.choose_pages(query)
        if call.path(planned=False, over_pages=True) is AttentionPath.OVER_PAGES:
            paged = self.chosen_pages(selection)  # None where the pool cannot give them in place
            if paged is not None:
                self.prefetch_expected_pages()
                return self._attention_over_pages(dataclasses.replace(step, paged=paged), query, attention_mask, call.kwargs)
        chosen = dataclasses.replace(step, read=self.read_chosen_pages(selection), identity=False)
        self.prefetch_expected_pages()
        mask = physical_mask(attention_mask, chosen, query.shape[1], call.float_mask_dtype)
        output, weights = call.run_inner(chosen.read.keys, chosen.read.values, mask)
        inputs = AttentionInputs(query, mask, weights, call.kwargs.get("scaling"), real_new_tokens(attention_mask, step))
        return output, weights, (step, inputs)

    def attend_returned(self, returned: ReturnedTokens, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of a call over keys and values this layer returned, other than the layer
        call's own (whose after-attention work already ran or is this call's to skip): a second
        call of the same layer (DiffLlama), or a layer sharing this one's (Gemma 3n). Over the
        tokens the call is handed, the model's mask moved onto their slots."""
        if self.module_layer != getattr(call.module, "layer_idx", self.module_layer):
            self.cache.serve_densely("shares one layer's keys and values with other layers", returned.complete, shapes_kept=True)
        elif not returned.complete:
            raise RuntimeError(
                f"layer {self.layer_idx}'s attention ran twice over keys and values kvlib returned as the new tokens only;"
                " this model's attention must be checked at its first call (a prefill) with this cache"
            )
        mask = call.attention_mask
        if not returned.identity:
            read = LayerRead(call.key, call.value, returned.positions, returned.valid)
            step = LayerStep(None, self.layer_idx, read, returned.query_offset, returned.query_length, False)
            mask = physical_mask(mask, step, call.query.shape[1], call.float_mask_dtype)
            move_position_bias(call.kwargs, step, call.query.shape[1])
        return call.run_inner(call.key, call.value, mask)

    def _check_call(self, step: LayerStep, call: AttentionCall) -> None:
        """Whether the model attends over exactly what ``update`` returned (the same key and
        value tensors, and a mask over logical positions that transformers' mask functions
        built, one row for every head); where it does more with them (JetMoE repeats them,
        DiffLlama splits the values, Doge builds a mask from them), the cache returns every
        stored token from then on (:meth:`KVCache.serve_densely`), or refuses what it cannot
        serve exactly. A layer is checked at its first call, whose step returns every token
        (:attr:`returns_new_tokens`)."""
        reason = None
        if call.key is not step.read.keys or call.value is not step.read.values:
            reason = "changes the keys or values the cache returns before attending over them"
        elif call.attention_mask is not None and call.attention_mask.dim() == 4 and call.attention_mask.shape[1] > 1:
            reason = "builds an attention mask of its own (one per head) from what the cache returns"
        if reason is not None:
            same_slots = (
                reason.startswith("changes")
                and call.key.shape[:3] == step.read.keys.shape[:3]
                and call.value.shape[:3] == step.read.values.shape[:3]
            )
            self.cache.serve_densely(reason, step.complete, shapes_kept=same_slots)
        self.checked = True

    @property
    def returns_new_tokens(self) -> bool:
        """Whether a call may attend straight over the pages, ``update`` returning just its new
        tokens: once the layer's first call was checked (:meth:`_check_call`) and the model does
        nothing else with what the cache returns."""
        return self.checked and self.cache.dense_returns is None

    def dense_step(self, step: LayerStep) -> LayerStep:
        """``step`` with the layer read back in dense form, for an attention function that
        cannot read pages (eager attention, attention sinks): a transient copy, not kept."""
        read = self.cache.store.read(self.layer_idx, self.cache.rows, mirror=False)
        return LayerStep(self, self.layer_idx, read, step.query_offset, step.query_length, self.identity)

    def choose_pages(self, query: torch.Tensor) -> torch.Tensor:
        """The pages the tiering policy chooses for ``query`` (``[batch, query_heads, 1,
        head_dim]``, after RoPE): int64 ``[batch, kv_heads, k]`` indices into each head's block
        table, ``-1`` for none (CPU)."""
        key_min, key_max, pages_used = self.cache.store.key_bounds(self.layer_idx, self.cache.rows)
        return self.cache.tiering.select_pages(self.layer_idx, query, key_min, key_max, pages_used)

    def chosen_pages(self, chosen: torch.Tensor) -> PagedLayer | None:
        """The ``chosen`` pages (:meth:`choose_pages`) where they lie, for attention straight over
        them; None where pages cannot be read in place (then :meth:`read_chosen_pages`). A chosen
        page whose spilled record is lost is left out (a miss: retrieval is approximate)."""
        if not reads_pages_in_place(self.cache.store.device):
            return None
        return self.cache.store.paged_selection(self.layer_idx, self.cache.rows, chosen, lost="miss")

    def prefetch_expected_pages(self) -> None:
        """Once this sparse step's pages are read: start fetching, from the host and disk, the
        pages the policy expects this layer's next sparse step to read
        (:meth:`~kvlib.policy.PageRetrieval.expected_pages`), so the copy overlaps the rest of the
        step (a store without a prefetcher fetches nothing)."""
        store = self.cache.store
        if store.prefetcher is None:
            return
        expected = self.cache.tiering.expected_pages(self.layer_idx)
        if expected is not None:
            store.prefetch_selection(self.layer_idx, self.cache.rows, expected)

    def read_chosen_pages(self, chosen: torch.Tensor) -> LayerRead:
        """The ``chosen`` pages (:meth:`choose_pages`), read sparsely into a dense copy."""
        return self.cache.store.read_selected(self.layer_idx, self.cache.rows, chosen, lost="miss")

    # -- after attention ------------------------------------------------------------------------

    def after_attention(self, step: LayerStep, inputs: AttentionInputs) -> None:
        """Once the layer's attention has run (``inputs``: what it saw; ``prompt_memo`` given by a
        shared prefill's replay): records padding (layer 0; counted per row, on the device), then
        :func:`~kvlib.adapters.runtime.after_attention.keep_up` with this layer's steps (see the
        module docstring). A planned step with nothing to evict only slides, seals and indexes."""
        cache = self.cache
        self.pending = None
        if self.recorder is not None:  # a layer the call took past its window is read before it slides
            stored = cache.store.read(self.layer_idx, cache.rows, mirror=False) if self.slides(0) else None
            self.recorder.observe(self.layer_idx, step, inputs=inputs, stored=stored)
        planned = cache.planned if step.plan is not None else None
        if planned is not None and planned.idle[self.layer_idx]:  # the common case: nothing follows
            return
        if self.layer_idx == 0 and inputs.real_new is not None:
            cache.padding += (~inputs.real_new).sum(-1)  # stays on the device: no sync per step
        if planned is not None:
            if inputs.real_new is None and planned.work[self.layer_idx] is not PlannedWork.GENERAL:
                self._slide()
                self.seal(None, [self.layer_idx], None)
                self.index(None)
                return
            step = dataclasses.replace(step, paged=cache.store.paged_layer(self.layer_idx, cache.rows))
        if cache.evictor is not None:
            inputs = dataclasses.replace(inputs, hidden_states=self.hidden_states)
            self.hidden_states = None
        keep_up(self, (step, inputs), step.read if step.paged is None else None)

    def layers_to_seal(self, call: Attended) -> list[int]:
        """Let this layer's codec, if it learns and is not ready, observe the call (its stored
        tokens and queries, padding marked invalid: :meth:`_fit_sample`); returns the layers whose
        full pages seal now: this one, or every layer up to it once a cross-layer fit became ready."""
        codecs = self.cache.codecs
        codec = codecs[self.layer_idx] if codecs is not None else None
        if codec is not None and codec.learns and not codec.ready:
            codec.observe(self._fit_sample(*call))
            if codec.ready:  # a cross-layer fit readies earlier layers too
                return list(range(self.layer_idx + 1))
        return [self.layer_idx]

    def _fit_sample(self, step: LayerStep, inputs: AttentionInputs) -> FitSample:
        """The layer's stored tokens (``step.read``) and this call's queries, padding marked invalid."""
        read, query = step.read, inputs.query
        real = read.valid & (read.positions >= self.cache.padding.view(-1, 1, 1))
        query_valid = inputs.real_new
        if query_valid is None:
            query_valid = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
        return FitSample(self.layer_idx, read.keys, read.values, real, query, query_valid)

    def evict(self, call: Attended) -> Evicted | None:
        """Let the evictor drop tokens of this layer
        (:func:`~kvlib.adapters.runtime.after_attention.evict`) from the layer as it now stands
        (:meth:`_stored_layer`); None without an evictor."""
        cache = self.cache
        if cache.evictor is None:
            return None
        step, inputs = call
        evicted = evict(
            cache.evictor, cache.store, cache.rows, self._stored_layer(step), inputs, cache.padding, reuse_slots=cache.reuse_slots
        )
        if evicted.layout is not None:
            self.identity = False
        return evicted

    def slide(self, call: Attended) -> torch.Tensor | None:
        return self._slide()

    def arrange(self, call: Attended, stored: LayerRead | None) -> bool:
        """Put the layer's tokens in the tiering policy's slot order where it arranges them
        (``shadowkv``, ``clusterkv``: tokens read together share pages); its view holds the real
        tokens, padding slots follow them, in slot order; per-slot evictor state follows."""
        cache, step = self.cache, call[0]
        if cache.tiering is None or step.sparse or not cache.tiering.arranges_tokens(self.layer_idx, step.query_length):
            return False
        stored = stored if stored is not None else cache.store.read(self.layer_idx, cache.rows)
        order = cache.tiering.arrangement(self._tiering_view(stored)).cpu()
        valid = stored.valid.cpu()
        slots = valid.shape[-1]
        named = torch.zeros(*valid.shape[:2], slots + 1, dtype=torch.bool).scatter_(-1, torch.where(order >= 0, order, slots), True)
        named = named[..., :slots]
        slot = torch.arange(slots).expand_as(valid)
        order = torch.cat([order, torch.where(valid & ~named, slot, -1)], dim=-1)
        order = order.gather(-1, torch.sort((order < 0).to(torch.int8), dim=-1, stable=True).indices)
        layout = cache.store.arrange(self.layer_idx, cache.rows, order[..., :slots])
        if cache.evictor is not None:
            cache.evictor.compacted(self.layer_idx, layout)
        self.identity = False
        return True

    def seal(self, call: Attended | None, layers: list[int], salience: Salience | None) -> None:
        """Seal the full pages of ``layers`` (a cache without codecs seals nothing), this layer's
        codec given ``salience`` if it reads it."""
        cache = self.cache
        if cache.codecs is None:
            return
        codec = cache.codecs[self.layer_idx]
        reads_salience = codec is not None and codec.uses_salience
        for layer in layers:
            cache.store.seal(layer, cache.rows, salience if layer == self.layer_idx and reads_salience else None)

    def rank(self, call: Attended, stored: LayerRead | None) -> None:
        """Re-rank the layer's pages for the device tier by the tiering policy's scores of its
        stored tokens (the layer as it now stands; padding never counts), when the policy refreshes
        its ranking now."""
        cache, step = self.cache, call[0]
        if cache.tiering is None or step.sparse or not cache.tiering.refreshes_ranking(self.seen, step.query_length):
            return
        stored = stored if stored is not None else cache.store.read(self.layer_idx, cache.rows)
        cache.store.rank_pages(self.layer_idx, cache.rows, cache.tiering.ranking_scores(self._tiering_view(stored)))

    def index(self, call: Attended | None) -> None:
        """After the last layer, index the prompt's full pages in the prefix session."""
        if self.cache.session is not None and self.layer_idx == self.cache.shape.num_layers - 1:
            self.cache.session.index(self.seen)

    def _tiering_view(self, stored: LayerRead) -> LayerView:
        """The layer's ``stored`` tokens as the tiering policy sees them: positions from each row's
        first real token, padding invalid (as if each row had been run alone)."""
        cache = self.cache
        padding = cache.padding.to(stored.positions.device).view(-1, 1, 1)
        real = stored.valid & (stored.positions >= padding)
        return LayerView(
            self.layer_idx,
            cache.shape.num_layers,
            stored.keys,
            stored.values,
            torch.where(real, stored.positions - padding, -1),
            real,
            page_size=cache.store.page_size,
        )

    @property
    def window(self) -> int | None:
        """This layer's sliding window (:meth:`KVShape.window`), or None where it sees every position."""
        return self.cache.shape.window(self.layer_idx)

    def slides(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` new tokens leaves positions behind this layer's window
        (then :meth:`_slide` has work after its attention)."""
        window = self.window
        return window is not None and self.seen + tokens >= window

    def _slide(self) -> torch.Tensor | None:
        """Free the stored tokens that left this layer's sliding window once it has seen
        ``seen`` tokens (:func:`~kvlib.adapters.runtime.after_attention.drop_behind_window`: every
        stored token at a logical position ``<= seen - window``, left padding included, as the
        model's masks count them). Returns the store's layout (the evictor's per-slot state
        follows it), or None where nothing was dropped: a layer without a window, or one holding
        nothing past it."""
        cache, window = self.cache, self.window
        if window is None or self.seen <= window - 1:
            return None
        layout = drop_behind_window(
            cache.store, cache.evictor, self.layer_idx, cache.rows, window, self.seen, reuse_slots=cache.reuse_slots
        )
        self.identity = self.identity and layout is None
        return layout

    def _stored_layer(self, step: LayerStep) -> LayerStep:
        """``step`` as the evictor sees it: the layer's stored tokens after the call's append.
        A call that attended over the pages (``step.paged``) read none of them: it gets their
        positions (:meth:`PagedStore.read_positions`; attention weights come from the pages), and
        the evictor reads keys and values into a transient dense copy only when it compacts
        with a policy that scores with them (``reads_kv``)."""
        if step.paged is None:
            return step
        return dataclasses.replace(step, read=self.cache.store.read_positions(self.layer_idx, self.cache.rows))

    def record_hidden_states(self, hidden_states: torch.Tensor) -> None:
        """Keep this layer call's attention input for a policy that needs ``hidden_states``."""
        if self.recorder is not None:
            self.recorder.hidden(self.layer_idx, hidden_states)
        evictor = self.cache.evictor
        if evictor is not None and "hidden_states" in evictor.policy.needs:
            self.hidden_states = hidden_states

    # -- lengths, crop, reset, inspection -------------------------------------------------------

    def get_seq_length(self) -> int:
        """Tokens seen (logical length, padding included)."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Masks span every logical position (kv length = seen + new, offset 0)."""
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the same question under its name before transformers 5.x (x < 24)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens seen (``<= 0``, checked by the cache, which
        holds rows). Under eviction the tokens to forget may sit in reused slots, not at the end:
        they are compacted away first (the evictor's per-slot state follows)."""
        cache, store = self.cache, self.cache.store
        length = max(self.seen + tokens_to_remove, 0)
        window = self.window
        if window is not None and self.seen >= window and length < self.seen:
            raise ValueError(
                f"layer {self.layer_idx} slides over a window of {window} tokens and has dropped the tokens before it:"
                f" it cannot go back to {length} tokens (as DynamicCache's sliding layers cannot once their window is full)"
            )
        if cache.evictor is not None:
            positions = store.stored_positions(self.layer_idx, cache.rows)
            slot = torch.arange(positions.shape[-1])
            keep = torch.where((positions >= 0) & (positions < length), slot, -1)
            cache.evictor.compacted(self.layer_idx, store.compact(self.layer_idx, cache.rows, keep, reuse_slots=cache.reuse_slots))
        store.truncate(self.layer_idx, cache.rows, length)
        self.seen = min(self.seen, length)

    def reset(self, seen: int = 0) -> None:
        """Forget the layer's state (the cache releases the tokens): ``seen`` tokens seen (a
        primed cache's reused prefix), nothing pending, slots equal to positions."""
        self.seen = seen
        self.identity = True
        self.pending = None
        self.hidden_states = None

    def kept_positions(self) -> torch.Tensor:
        """Original positions of the tokens this layer stores: int64 ``[batch, kv_heads, max_kept]``,
        ascending (whatever slots hold them), padded with -1 (CPU); counted from each row's first
        real token (left padding excluded), as if the row had been run alone."""
        stored = self.cache.store.stored_positions(self.layer_idx, self.cache.rows)
        positions = stored - self.cache.padding.cpu().view(-1, 1, 1)
        real = (stored >= 0) & (positions >= 0)
        return ascending(torch.where(real, positions, -1))[..., : int(real.sum(-1).max())]
