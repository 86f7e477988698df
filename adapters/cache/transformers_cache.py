"""``KVCache``: a `transformers` ``Cache`` backed by the paged store.

Each batch row is a store sequence. The cache holds what its layers share: the paged store (built
when the cache is, from the model's dtype and device), the rows and their left padding, the
evictor, codecs, tiering policy and prefix session. Each
:class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer` owns its layer's state and work: ``update``
appends the layer's new keys and values and publishes a
:class:`~kvlib.adapters.runtime.layer_step.LayerStep` for the kvlib attention function, which attends
through the step and then runs the layer's after-attention work (eviction, sealing, ranking,
prefix indexing).

Lengths: ``get_seq_length`` is the logical length (tokens seen, padding included, as in
``DynamicCache``) so models place new tokens at their true positions after eviction; masks are
built over logical positions (``get_mask_sizes``) and translated to the stored slots.

Batch operations (``reorder_cache`` for beam search, ``batch_repeat_interleave``,
``batch_select_indices``) fork store sequences, which span every layer: rows that share a history
share its pages by reference, copy-on-write (:meth:`KVCache.fork`, :meth:`KVCache.reorder_cache`). A decode
step is planned for every layer before the forward runs (:mod:`~kvlib.adapters.cache.step_planning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from transformers.cache_utils import Cache

from kvlib.adapters.cache.cache_layer import NOT_THROUGH_KVLIB, KVCacheLayer
from kvlib.adapters.cache.cache_store import CacheStoreBuilder
from kvlib.adapters.cache.compiled_calls import new_handle
from kvlib.adapters.cache.dense_layer import DenseKVCacheLayer
from kvlib.adapters.cache.memory_report import memory_report
from kvlib.adapters.cache.planned_decode import PlannedDecode
from kvlib.adapters.cache.prefix_session import PrefixSession
from kvlib.adapters.cache.recomputed_layer import RecomputedKVCacheLayer, checkpoint_shape
from kvlib.adapters.cache.state_layers import cache_layers, select_state_rows, state_bytes, state_layers
from kvlib.adapters.cache.step_planning import plan_decode_step
from kvlib.adapters.runtime.evictor import Evictor
from kvlib.codec import Codec, PageCodec
from kvlib.devices import reads_pages_in_place
from kvlib.model_shape import KVShape
from kvlib.policy import CheckpointProjection, Tiering
from kvlib.storage.prefix.prefix_store import PrefixStore
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.tiers.spill_store import SpillStore


def _exclusive(method: Callable) -> Callable:
    """``method`` of a :class:`KVCache` run as :meth:`KVCache.enter_call` (no claim) ...
    :meth:`KVCache.leave_call`: refused from a thread other than the owner's, and holding the
    cache's PrefixStore lock while it changes the shared store."""

    @functools.wraps(method)
    def run(cache: KVCache, *args, **kwargs):
        cache.enter_call(claim=False)
        try:
            return method(cache, *args, **kwargs)
        finally:
            cache.leave_call()

    return run


class KVCache(Cache):
    """A drop-in ``transformers`` cache over kvlib's paged store; build it with :func:`kvlib.make_cache`.

    Args:
        shape: the model's KV layout.
        evictor: eviction to run after each layer's attention, or None (exact cache).
        page_size: tokens per page.
        read_cache: keep a dense mirror of each layer so decode steps copy only new tokens (its
            bytes are reported as ``read_cache``). None chooses: a mirror only where attention
            cannot read pages in place (:func:`~kvlib.devices.reads_pages_in_place`: an exact
            cache on CUDA until its paged kernel is wired), never with an eviction policy, a
            codec or tiering. Decode steps attend straight over the pages; under eviction the
            compaction after them reads each layer's positions only when the policy scores
            without keys and values (``Eviction.reads_kv``), else a transient dense copy.
        codec: the quantization or low-rank policy that encodes sealed pages, or None. Its
            per-layer codecs are built with the store (fitted codecs learn from each layer's
            first call), and full pages are sealed after each layer's attention.
        reuse: a :class:`~kvlib.PrefixStore` whose paged store this cache lives in (see :meth:`prime`).
        spec: the spec string that keys this cache's pages in ``reuse`` (``""``: exact).
        home: the model's ``(dtype, device)`` (:func:`~kvlib.make_cache` passes its parameters'):
            the store is built there at construction. None (a cache constructed without it):
            the store is built by the first update (or :meth:`load`) in its tensors' dtype and
            device, and :meth:`prime` builds it in float32 on the CPU.
        tiering: a placement policy (``lru``, ``score_aware``) keeping part of the pages in host
            memory and, with ``lru``'s ``disk``, in page records there (this cache's run: see
            :attr:`spill`; a directory that cannot hold a disk tier is a ``ValueError`` here, as
            spilled pages would have nowhere to go), or ``quest``, whose decode steps attend over
            the pages their query chooses.
        compileable: what ``is_compileable`` reports. True lets ``generate`` compile its decode
            steps itself (``get_compiled_call``; on CUDA by default, with ``mode="reduce-overhead"``)
            and build 4-D masks outside the forward; False by default, because the cache's masks
            grow by one column each step: inductor then compiles dynamic shapes once, but CUDA
            graphs would be recorded anew for every width. Compiling ``model.forward`` or the
            model yourself works either way.
        dense: serve a model whose attention kvlib cannot route (it computes attention itself over
            what ``update`` returns): see :mod:`~kvlib.adapters.cache.dense_layer`. Exact caches only.
        projections: a recompute policy's projections, one per KV layer (``kv_direct``): the layers
            store checkpoints and attend over recomputed keys and values, no step planned (see
            :mod:`~kvlib.adapters.cache.recomputed_layer`). No other policy goes with them.
    """

    def __init__(
        self,
        shape: KVShape,
        evictor: Evictor | None = None,
        *,
        page_size: int = 16,
        read_cache: bool | None = None,
        codec: Codec | None = None,
        reuse: PrefixStore | None = None,
        spec: str = "",
        home: tuple[torch.dtype, torch.device] | None = None,
        tiering: Tiering | None = None,
        compileable: bool = False,
        dense: bool = False,
        projections: list[CheckpointProjection] | None = None,
    ) -> None:
        self.dense = dense or projections is not None
        """No step is planned: the model attends over what ``update`` returns, itself (its attention
        is outside ``AttentionInterface``: every KV layer is a :class:`DenseKVCacheLayer`), or its
        layers recompute keys and values (:class:`RecomputedKVCacheLayer`)."""
        self.projections = projections
        """Per KV layer, how its keys and values are recomputed from the checkpoints it stores (None:
        the layers store keys and values)."""
        layer_class = RecomputedKVCacheLayer if projections is not None else DenseKVCacheLayer if dense else KVCacheLayer
        layers, self.kv_layers = cache_layers(self, shape, layer_class)
        """The KV layers (:class:`KVCacheLayer`), in KV-layer order: ``layers`` (one per model
        layer, as transformers indexes them) minus a hybrid model's recurrent-state and empty layers."""
        super().__init__(layers=layers)
        self.compileable = compileable
        self.state_layers = state_layers(self.layers)
        """The layers keeping state outside the pages: recurrent or convolution states, indexer keys
        (:mod:`~kvlib.adapters.cache.state_layers`)."""
        self.shape = shape
        self.evictor = evictor
        self.page_size = page_size
        if read_cache is None:
            device = home[1] if home is not None else torch.device("cpu")
            read_cache = not reads_pages_in_place(device) and evictor is None and codec is None and tiering is None
        self.read_cache = read_cache
        self.reuse_slots = True
        """Decode-step evictions move the newest kept token into the evicted one's slot
        (:meth:`PagedStore.compact`'s slot reuse); False keeps every head's slots in position
        order at the cost of rewriting its pages from the first hole (what benchmarks compare)."""
        self.codec = codec
        self.reuse = reuse
        self.spec = spec
        self.home = home
        self.tiering = tiering
        self.builder = CacheStoreBuilder(
            shape if projections is None else checkpoint_shape(shape, projections),
            page_size=page_size,
            read_cache=read_cache,
            codec=codec,
            tiering=tiering,
            reuse=reuse,
            spec=spec,
        )
        self.session: PrefixSession | None = None
        self.recompute: torch.Tensor | None = None
        """Inside :meth:`recomputing`: the stored positions the forward calls rewrite."""
        self._rows: list[int] = []
        self.padding = torch.zeros(0, dtype=torch.int64)
        """Left padding tokens of each row, int64 ``[batch]`` on the store's device (counted by layer 0's calls)."""
        self.planned: PlannedDecode | None = None
        """The current decode step planned for every layer (see :meth:`prepare_step`), or None
        where the step takes the general path layer by layer."""
        self.prepared = False
        """Whether :meth:`prepare_step` ran for the coming call (layer 0's update clears it)."""
        self._owner: int | None = None
        """The thread using this cache (``threading.get_ident()``), recorded at its first model call
        and released by :meth:`reset`; another thread is refused (:meth:`check_thread`)."""
        self._store_lock_depth, self._store_lock_thread = 0, 0
        """How many times, and by which thread, this cache holds its PrefixStore's lock now."""
        """Whether :meth:`prepare_step` ran for the coming call (layer 0's update clears it)."""
        self.store: PagedStore | None = self.builder.new_store(*home) if home is not None and not self.measures_layout else None
        self.dense_returns: str | None = None
        """Why this cache's layers return every stored token from ``update`` (what the model does
        with them besides attending, :meth:`serve_densely`), or None: a decode step returns just
        its new tokens and attends straight over the pages."""
        self.handle = new_handle(self)
        """What names this cache to the operators of a compiled forward (:mod:`~kvlib.adapters.cache.compiled_calls`)."""

    @property
    def measures_layout(self) -> bool:
        """Whether this cache takes its KV layout from its first call (:meth:`measure_layout`): a
        dense cache of a model outside ``AttentionInterface``, whose store is built then."""
        return self.dense and self.shape.own_attention and not self.shape.latent

    def measure_layout(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take the KV layout from the first call's keys and values (``[batch, kv_heads, tokens,
        dim]``) for every layer. Models outside ``AttentionInterface`` lay their cache out their own
        way (Falcon's multi-query and grouped layouts, CPM-Ant's head size), which their config
        does not always state, and each of them gives every layer one layout."""
        layers = self.shape.num_layers
        self.shape = self.builder.shape = dataclasses.replace(
            self.shape,
            layer_kv_heads=(key_states.shape[1],) * layers,
            layer_query_heads=(max(key_states.shape[1], self.shape.layer_query_heads[0]),) * layers,
            layer_head_dims=(key_states.shape[-1],) * layers,
            layer_value_dims=(value_states.shape[-1],) * layers,
        )

    @property
    def rows(self) -> list[int]:
        """The store sequence of each batch row (the list a prefix session shares)."""
        return self._rows

    @property
    def codecs(self) -> list[PageCodec | None] | None:
        """The store's per-layer codecs (None without a codec, or before the store exists)."""
        return self.builder.codecs

    @property
    def spill(self) -> SpillStore | None:
        """This cache's spilled pages on disk (see :class:`CacheStoreBuilder`)."""
        return self.builder.spill

    # -- what generate and the model call -----------------------------------------------------

    def start_call(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """What a layer call that was not planned checks and starts first (:meth:`KVCacheLayer.update`
        calls it; ``transformers``' ``Cache.update`` hands each layer call straight to its layer):
        the previous layer's attention ran through kvlib where its eviction or codec must run, the
        batch fits, the store exists (in ``key_states``' dtype and device for a cache made without
        them) and the batch's rows are started (from a prefix session where the cache reuses one)."""
        previous = self.kv_layers[layer_idx - 1]
        if previous.pending is not None and (self.evictor is not None or self.codec is not None):
            raise RuntimeError(NOT_THROUGH_KVLIB.format(layer=previous.layer_idx))
        batch = key_states.shape[0]
        self.check_thread()
        self.check_batch(batch)
        if self.store is None:
            self.store = self.builder.new_store(key_states.dtype, key_states.device)
        if not self._rows:
            if self.reuse is not None:  # rows in the PrefixStore's store: a session gives them back
                namespace = self.builder.namespace(key_states.dtype, key_states.device)
                self.session = PrefixSession.start(self, self.reuse, namespace, self.store, self._rows, None, batch)
            else:
                self._rows.extend(self.store.new_sequence() for _ in range(batch))
            self.padding = torch.zeros(batch, dtype=torch.int64, device=self.store.device)

    def prepare_step(self, tokens: int, attention_mask: torch.Tensor | None = None, *, mask_known: bool = True) -> None:
        """Plan the coming model call of ``tokens`` new tokens per row for every layer, where it is
        a decode step the paged store can plan (see :mod:`kvlib.storage.store.step_plan`), and work out which
        layers have anything to do after their attention. The forward pre-hook that
        :func:`kvlib.attach` adds calls it with the call's ``attention_mask`` (2-D, or None: no
        padding), so that the forward itself keeps no books (``model.forward`` compiled with
        ``torch.compile(fullgraph=True)`` traces a planned step whole); layer 0's update calls it
        when nothing did (``mask_known`` False: whether the new tokens are real is then read from
        the mask attention gets). Each layer's update then takes :attr:`planned` if it is one of
        its call's tokens. When there is no plan (the step goes layer by layer), and what a plan
        sets: :mod:`~kvlib.adapters.cache.step_planning`."""
        self.prepared = True
        self.planned = plan_decode_step(self, tokens, attention_mask, mask_known)

    def serve_densely(self, reason: str, complete: bool, *, shapes_kept: bool) -> None:
        """From now on, every layer's ``update`` returns all the tokens it stores, as
        ``DynamicCache.update`` does, and attention runs over what the model hands it: the
        model's attention ``reason`` (does more with what the cache returns than attend over it).

        Refused (``ValueError``, before the call's attention runs): a call that was handed only
        its new tokens (``complete`` False: the model must meet the cache first in a prefill),
        and eviction where the model's use of the keys and values does not keep their batch, head
        and token layout (``shapes_kept`` False: their slots no longer match the stored ones)."""
        if not complete:
            raise ValueError(
                f"this model's attention {reason}, which kvlib learned only after returning the new tokens alone;"
                " start the cache with a prefill of the prompt (a fresh cache), not a primed, loaded or forked one"
            )
        if self.evictor is not None and not shapes_kept:
            raise ValueError(
                f"this model's attention {reason}: kvlib serves it exactly without eviction (codecs and tiering"
                f" included), but cannot apply {self.evictor.policy.spec()} to it"
            )
        self.dense_returns = reason

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill this empty cache with precomputed keys (after RoPE) and values of every layer,
        ``[batch, kv_heads, tokens, dim]`` each, as tokens at positions ``0 .. tokens - 1``."""
        if self._rows or any(layer.seen for layer in self.kv_layers):
            raise ValueError("load needs an empty cache: call reset() first")
        if len(keys) != self.shape.num_layers or len(values) != self.shape.num_layers:
            raise ValueError(f"load takes keys and values for each of the {self.shape.num_layers} layers")
        if self.store is None:
            self.store = self.builder.new_store(keys[0].dtype, keys[0].device)
        self._rows.extend(self.store.new_sequence() for _ in range(keys[0].shape[0]))
        for layer, k, v in zip(self.kv_layers, keys, values):
            layer.load(k, v)
        self.padding = torch.zeros(keys[0].shape[0], dtype=torch.int64, device=self.store.device)

    @contextlib.contextmanager
    def recomputing(self, positions: torch.Tensor) -> Iterator[None]:
        """Forward calls inside recompute stored tokens at ``positions`` (int ``[tokens]``, ascending,
        the order of the call's inputs): each layer overwrites their keys and values with the new
        ones, and their queries attend causally by these positions (CacheBlend's selective
        recompute). Pass ``position_ids=positions[None]`` to the model."""
        if not self._rows:
            raise ValueError("recomputing needs a cache holding the tokens (load() or a prefill first)")
        self.recompute = torch.as_tensor(positions, dtype=torch.int64).cpu()
        try:
            yield
        finally:
            self.recompute = None

    # -- threads ------------------------------------------------------------------------------

    def check_thread(self, claim: bool = True) -> None:
        """``RuntimeError`` (one line) when a thread other than this cache's owner uses it; with
        ``claim``, a cache no thread owns yet becomes the calling thread's. A cache serves one
        generation at a time: kvlib refuses the second thread rather than let both write wrong
        output (``DynamicCache`` does not check)."""
        me = threading.get_ident()
        if self._owner is None:
            if claim:
                self._owner = me
        elif self._owner != me:
            raise RuntimeError(
                f"this KVCache is in use by thread {self._owner}, and thread {me} called it: a cache serves one thread at a"
                " time; make a cache per thread (kvlib.make_cache), or reset() it in its thread before handing it over"
            )

    def enter_call(self, claim: bool = True) -> None:
        """Start a call that may change the store: the thread is checked (:meth:`check_thread`) and,
        for a cache living in a :class:`~kvlib.PrefixStore`'s paged store (shared with other
        caches, other threads' included), the store's lock is taken until :meth:`leave_call`. The
        forward hooks of :func:`kvlib.attach` hold it for each model call."""
        self.check_thread(claim)
        if self.reuse is not None:
            self.reuse.lock.acquire()
            self._store_lock_depth += 1
            self._store_lock_thread = threading.get_ident()

    def leave_call(self) -> None:
        """End a call :meth:`enter_call` started (nothing when this thread holds no lock for it)."""
        if self._store_lock_depth and self._store_lock_thread == threading.get_ident():
            self._store_lock_depth -= 1
            self.reuse.lock.release()

    def check_batch(self, batch: int) -> None:
        """``ValueError`` unless a batch of ``batch`` rows may use this cache (it is empty, or holds that many)."""
        if self._rows and batch != len(self._rows):
            raise ValueError(
                f"this cache holds a batch of {len(self._rows)} sequences but got a batch of {batch}; call cache.reset()"
                " before reusing it for another batch"
            )

    @_exclusive
    def prime(self, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Start this (empty) cache from the longest prefix of ``prompt`` (int ``[batch, tokens]``)
        cached in its :class:`~kvlib.PrefixStore`, and index the prompt's full pages once computed.

        Returns the tokens reused: whole pages common to every row, never the prompt's last token.
        ``generate(prompt, cache=cache)`` then runs the model on the rest only. Prime
        with the rows ``generate`` runs (beam search: each prompt ``num_beams`` times). A
        left-padded ``attention_mask`` (any zero) disables reuse: padded pages depend on the mask.
        """
        if self.reuse is None:
            raise ValueError("prime needs a cache made with reuse=PrefixStore(...)")
        if self._rows or any(layer.seen for layer in self.kv_layers):
            raise ValueError("prime needs an empty cache: call reset() first")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype.is_floating_point or prompt.shape[1] < 1:
            raise ValueError("prompt must be an integer tensor [batch, tokens] with at least one token")
        if attention_mask is not None and not bool(attention_mask.all()):
            return 0
        dtype, device = self.home or (torch.float32, torch.device("cpu"))
        self.store = self.builder.shared_store(dtype, device)
        namespace = self.builder.namespace(dtype, device)
        self.session = PrefixSession.start(self, self.reuse, namespace, self.store, self._rows, prompt.cpu(), prompt.shape[0])
        reused = self.session.reused_tokens
        for layer in self.kv_layers:
            layer.reset(seen=reused)
        self.padding = torch.zeros(prompt.shape[0], dtype=torch.int64, device=self.store.device)
        return reused

    @_exclusive
    def index_tokens(self, tokens: torch.Tensor) -> None:
        """Index, in the cache's PrefixStore, the full pages of ``tokens`` (int ``[batch, n]``: the
        prompt the cache was primed with, then what it generated, as ``generate`` returns them), so
        that the next turn of a conversation reuses the answer too. Only tokens the cache holds
        count (the last generated token has no KV yet)."""
        if self.session is None or not self.session.blocks or self.reuse is None:
            raise ValueError("index_tokens needs a cache primed from a PrefixStore (make_cache(reuse=..., prompt=...))")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError("tokens must be an integer tensor [batch, tokens]")
        self.session.extend(tokens.cpu(), min(layer.seen for layer in self.kv_layers))

    def record_hidden_states(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """Keep the input of the attention module whose ``layer_idx`` this is, for a policy that
        needs ``hidden_states``."""
        self.kv_layers[self.shape.module_layers.index(layer_idx)].record_hidden_states(hidden_states)

    def record_checkpoint(self, layer_idx: int, hidden_states: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Hand model layer ``layer_idx``'s attention input and position ids to its KV layer, where
        the layers store checkpoints (:attr:`projections`; other caches keep nothing)."""
        if self.projections is not None:
            self.kv_layers[self.shape.module_layers.index(layer_idx)].record_checkpoint(hidden_states, position_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (logical length, padding included) by model layer ``layer_idx`` (by the
        first KV layer for layer 0 of a model whose layer 0 keeps recurrent state only)."""
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Masks span every logical position (kv length = seen + new, offset 0)."""
        return super().get_mask_sizes(query_length, layer_idx)

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first update."""
        return len(self._rows) or -1

    # -- batch operations -----------------------------------------------------------------------

    @_exclusive
    def reset(self) -> None:
        """Forget every stored token (pages go back to the pool); the next update starts a new batch."""
        if self.session is not None:  # the store is the PrefixStore's: give back what this cache held
            self.session.close()
            self.session = None
        elif self.codecs is not None:  # fitted codecs belong to the old prompt: start a new store
            if self._rows:  # a fork's store is shared: give its pages back
                self.store.release(self._rows)
            self.builder.codecs = None
            self.store = self.builder.new_store(*self.home) if self.home is not None else None
        elif self._rows:
            self.store.release(self._rows)
            self.store.peak_page_bytes = self.store.memory_bytes()["pages"]
        self._rows.clear()
        self.padding = torch.zeros(0, dtype=torch.int64)
        self.planned = None
        for layer in self.layers:
            layer.reset()
        if self.evictor is not None:
            self.evictor.reset()
        self._owner = None  # empty again: any thread may take it

    @_exclusive
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of old row ``beam_idx[i]`` (beam search)."""
        self._select_rows(beam_idx)

    @_exclusive
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place (``[a, b] -> [a, a, b, b]``)."""
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self._select_rows(torch.arange(max(len(self._rows), 0)).repeat_interleave(repeats))

    @_exclusive
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows at ``indices`` (in that order; repeats allowed)."""
        self._select_rows(indices)

    @_exclusive
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens seen (``tokens_to_remove <= 0``, as in ``DynamicCache``).

        Rolling back is exact for the tokens themselves; tokens an eviction already dropped to
        make room for them stay dropped (``is_croppable`` is False when the spec evicts).
        """
        if not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative int, the number of tokens to remove (0 does nothing); got {tokens_to_remove!r}")
        if tokens_to_remove == 0 or not self._rows:
            return
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def fork(self) -> KVCache:
        """A new cache holding what this one holds, by reference: each row's pages shared
        (copy-on-write: tokens either cache adds later go to pages of its own), each layer's
        length and slot order, the rows' padding. For several continuations of one computed
        prefix, at once or one after another, without computing it again (a compressed context
        and its questions: :func:`kvlib.adapters.compressed_context`).

        The fork evicts nothing: it keeps every token added to it. Refused (``ValueError``): a
        cache that still evicts (its policy's per-row state is its own; fork once eviction is
        over, as :func:`~kvlib.policies.eviction.kvzip.compress` leaves a cache), one primed from
        a PrefixStore (its session owns its rows), one with a tiering policy (its spilled pages
        are its own), one of a hybrid model (its recurrent states are not paged) and one that
        holds nothing yet.
        """
        self._check_forkable()
        copy = KVCache(
            self.shape,
            page_size=self.page_size,
            read_cache=self.read_cache,
            codec=self.codec,
            spec=self.spec,
            compileable=self.compileable,
            dense=self.dense,
            projections=self.projections,
        )
        copy.dense_returns = self.dense_returns
        copy.home = self.home
        copy.builder.codecs = self.builder.codecs  # fitted codecs of the shared pages
        copy.store = self.store
        copy.reuse_slots = self.reuse_slots
        copy.rows.extend(self.store.fork(row) for row in self.rows)
        copy.padding = self.padding.clone()
        for mine, theirs in zip(copy.kv_layers, self.kv_layers):
            mine.seen, mine.identity = theirs.seen, theirs.identity
        return copy

    def _check_forkable(self) -> None:
        """``ValueError`` for a cache that still evicts, one primed from a PrefixStore, one with a
        tiering policy, one whose layers keep state outside the pages, and one that holds nothing
        yet (see :meth:`fork`)."""
        if self.evictor is not None:
            raise ValueError(f"fork needs a cache that no longer evicts; this one runs {self.evictor.policy.spec()}")
        if self.session is not None:
            raise ValueError("fork is for caches outside a PrefixStore; this one was primed from one (make_cache(reuse=...))")
        if self.tiering is not None:
            raise ValueError(f"fork is for caches without tiering; this one spills pages with {self.tiering.spec()}")
        if self.state_layers:
            raise ValueError(
                "fork shares pages by reference; this model's layers keep state outside the pages (recurrent states, indexer keys),"
                " which a fork cannot share"
            )
        if not self.rows:
            raise ValueError("the cache holds no tokens yet: run the model with it first")

    def _select_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes a fork of old row ``index[i]`` in every layer (store sequences span
        layers; no page is copied, the old rows' references are released); the padding, the
        evictor's per-row state and the state that layers keep outside the pages (a hybrid
        model's recurrent states, a sparse-attention indexer's keys) follow. The row list is
        changed in place (a prefix session shares it). ``ValueError`` for an index out of range."""
        rows = self.rows
        if not rows:
            return
        index = torch.as_tensor(index).to("cpu", torch.int64).flatten()
        if bool(((index < 0) | (index >= len(rows))).any()):
            raise ValueError(f"row indices must be in [0, {len(rows)}), got {index.tolist()}")
        if index.tolist() == list(range(len(rows))):
            return
        old = list(rows)
        rows[:] = [self.store.fork(old[i]) for i in index.tolist()]
        self.store.release(old)
        self.padding = self.padding[index.to(self.padding.device)]
        if self.evictor is not None:
            self.evictor.select_rows(index)
        for layer in self.state_layers:
            select_state_rows(layer, index)

    # -- inspection -----------------------------------------------------------------------------

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Original positions of the tokens ``layer_idx`` stores (see :meth:`KVCacheLayer.kept_positions`)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.shape.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, {self.shape.num_layers}), got {layer_idx!r}")
        if not self._rows:
            raise ValueError("the cache holds no tokens yet: run the model with it first")
        return self.kv_layers[layer_idx].kept_positions()

    def memory_report(self) -> dict:
        """Bytes this cache holds, and what a full cache in the compute dtype would hold (see
        :func:`~kvlib.adapters.cache.memory_report.memory_report` for the keys), and ``slack_tokens``:
        the stored tokens over the held cap (an int budget) that its ``slack`` holds now, summed
        over layers, rows and KV heads (0 for a ring, which never holds more than the cap)."""
        return memory_report(self.store, self._rows, self.shape, self.evictor, state_bytes(self.state_layers))

    def __repr__(self) -> str:
        spec = "exact" if self.evictor is None else f"{self.evictor.policy.spec()}, budget={self.evictor.budget}"
        if self.codec is not None:
            spec += f", codec={self.codec.spec()}"
        return f"KVCache({spec}, layers={self.shape.num_layers}, batch={len(self._rows)})"
