"""``KVCache``: a `transformers` ``Cache`` backed by the paged store.

Each batch row is a store sequence. ``update`` appends a layer's new keys and values, reads the
layer back in dense form (physical slots) and publishes a :class:`~kvlib.adapters.layer_step.LayerStep`
for the kvlib attention function, which masks by stored positions and, after attention, calls
:meth:`KVCache.after_attention` so the spec's eviction strategy can drop tokens.

Lengths: ``get_seq_length`` is the logical length (tokens seen, padding included, as in
``DynamicCache``) so models place new tokens at their true positions after eviction; masks are
built over logical positions (``get_mask_sizes``) and translated to the stored slots.

Batch operations (``reorder_cache`` for beam search, ``batch_repeat_interleave``,
``batch_select_indices``) fork store sequences: rows that share a history share its pages by
reference, copy-on-write.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib.adapters import layer_step
from kvlib.adapters.compressor import AttentionInputs, Compressor
from kvlib.adapters.layer_step import LayerStep
from kvlib.adapters.model_shape import KVShape
from kvlib.adapters.prefix_session import PrefixSession
from kvlib.codec import Codec, FitSample, PageCodec, layer_shapes
from kvlib.devices import reads_pages_in_place
from kvlib.errors import DiskTierUnavailable
from kvlib.paged_attention import PagedLayer
from kvlib.paged_store import PagedStore
from kvlib.prefix_store import PrefixStore
from kvlib.read_cache import LayerRead
from kvlib.store_config import StoreConfig
from kvlib.storage.disk_tier import DiskTier, open_disk_tier
from kvlib.storage.page_prefetch import PagePrefetcher
from kvlib.storage.page_record import Layout, record_size
from kvlib.storage.spill_store import SpillStore
from kvlib.strategy import LayerView, Tiering


PAGED_QUERY_TOKENS = 16
"""Calls with at most this many new tokens attend straight over the pages (see
:meth:`KVCache._paged_layer`); longer ones (prefill, chunks) read the layer into a transient
dense copy for SDPA."""


class KVCacheLayer(CacheLayerMixin):
    """One layer of a :class:`KVCache`, as `transformers` inspects it; the cache does the work."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        self.keys = self.values = None
        self._cache = cache
        self.layer_idx = layer_idx

    @property
    def is_initialized(self) -> bool:
        return self._cache.batch_size > 0

    @property
    def is_croppable(self) -> bool:
        return self._cache.compressor is None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache creates its store on the first update."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length(self.layer_idx) + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the same question under its name before transformers 5.x (x < 24)


class KVCache(Cache):
    """A drop-in ``transformers`` cache over kvlib's paged store; build it with :func:`kvlib.make_cache`.

    Args:
        shape: the model's KV layout.
        compressor: eviction to run after each layer's attention, or None (exact cache).
        page_size: tokens per page.
        read_cache: keep a dense mirror of each layer so decode steps copy only new tokens (its
            bytes are reported as ``read_cache``). None chooses: a mirror only where attention
            cannot read pages in place (:func:`~kvlib.devices.reads_pages_in_place`: an exact
            cache on CUDA until its paged kernel is wired), never with an eviction strategy, a
            codec or tiering. Decode steps attend straight over the pages; under eviction the
            compaction after them reads each layer's positions only when the strategy scores
            without keys and values (``Eviction.reads_kv``), else a transient dense copy.
        codec: the quantization or low-rank strategy that encodes sealed pages, or None. Its
            per-layer codecs are built with the store (first update; fitted codecs learn from
            each layer's first call), and full pages are sealed after each layer's attention.
        reuse: a :class:`~kvlib.PrefixStore` whose paged store this cache lives in (see :meth:`prime`).
        spec: the spec string that keys this cache's pages in ``reuse`` (``""``: exact).
        home: the model's ``(dtype, device)``, where a primed cache's pages live before any update.
        tiering: a placement strategy (``lru``, ``score_aware``) keeping part of the pages in host
            memory and, with ``lru``'s ``disk``, in page records there (this cache's run: see
            :attr:`spill`; a directory that cannot hold a disk tier is a ``ValueError`` here, as
            spilled pages would have nowhere to go), or ``quest``, whose decode steps attend over
            the pages their query chooses.
    """

    def __init__(
        self,
        shape: KVShape,
        compressor: Compressor | None = None,
        *,
        page_size: int = 16,
        read_cache: bool | None = None,
        codec: Codec | None = None,
        reuse: PrefixStore | None = None,
        spec: str = "",
        home: tuple[torch.dtype, torch.device] = (torch.float32, torch.device("cpu")),
        tiering: Tiering | None = None,
    ) -> None:
        super().__init__(layers=[KVCacheLayer(self, i) for i in range(shape.num_layers)])
        self.shape = shape
        self.compressor = compressor
        self.page_size = page_size
        if read_cache is None:
            read_cache = not reads_pages_in_place(home[1]) and compressor is None and codec is None and tiering is None
        self.read_cache = read_cache
        self.reuse_slots = True
        """Decode-step evictions move the newest kept token into the evicted one's slot
        (:meth:`PagedStore.compact`'s slot reuse); False keeps every head's slots in position
        order at the cost of rewriting its pages from the first hole (what benchmarks compare)."""
        self.codec = codec
        self.codecs: list[PageCodec | None] | None = None
        self.reuse = reuse
        self.spec = spec
        self.home = home
        self.tiering = tiering
        self.spill: SpillStore | None = None
        """This cache's spilled pages on disk (opened with the store; records deleted as pages
        are freed, all of them when the cache is garbage collected or the process exits)."""
        self._spill_tier = _spill_tier(tiering)
        self._session: PrefixSession | None = None
        self._recompute: torch.Tensor | None = None
        self.store: PagedStore | None = None
        self._rows: list[int] = []
        self._padding = torch.zeros(0, dtype=torch.int64)
        self._identity = [True] * shape.num_layers
        self._seen = [0] * shape.num_layers
        self._pending: LayerStep | None = None
        self._hidden_states: dict[int, torch.Tensor] = {}

    # -- what generate and the model call -----------------------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args,
        kwargs: dict | None = None,
        **_,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer call's new keys and values; return all the layer's stored ones (dense).

        ``kwargs``: the layer call's attention keyword arguments (transformers 5.24+); the
        :class:`LayerStep` for the kvlib attention function travels in them (see
        :mod:`~kvlib.adapters.layer_step`)."""
        if self._pending is not None and (self.compressor is not None or self.codec is not None):
            raise RuntimeError(
                f"layer {self._pending.layer_idx}'s attention did not run through kvlib, so its eviction or codec cannot run:"
                " call kvlib.attach(model) (make_cache does) and keep attn_implementation on kvlib_sdpa / kvlib_eager"
            )
        batch = key_states.shape[0]
        self.check_batch(batch)
        if self._recompute is not None:
            return self._overwrite(key_states, value_states, layer_idx, kwargs)
        if self.store is None:
            self.store = self._new_store(key_states)
        if not self._rows:
            if self.reuse is not None:  # rows in the PrefixStore's store: a session gives them back
                namespace = self.reuse.namespace(self.spec, key_states.dtype, key_states.device, self.page_size)
                self._session = PrefixSession.start(self, self.reuse, namespace, self.store, self._rows, None, batch)
            else:
                self._rows.extend(self.store.new_sequence() for _ in range(batch))
            self._padding = torch.zeros(batch, dtype=torch.int64, device=self.store.device)
        offset = self._seen[layer_idx]
        first_tokens = self._holds_nothing(layer_idx, key_states)
        self.store.append(layer_idx, self._rows, key_states, value_states)
        self._seen[layer_idx] += key_states.shape[2]
        if self.tiering is not None and self.tiering.retrieves_pages and self.tiering.sparse(layer_idx, key_states.shape[2]):
            return self._publish_new_tokens(key_states, value_states, layer_idx, offset, kwargs, sparse=True)
        if first_tokens:  # the layer holds exactly this call's tokens: attention runs over them as given
            return self._publish_new_tokens(key_states, value_states, layer_idx, offset, kwargs, identity=self._identity[layer_idx])
        paged = self._paged_layer(layer_idx, key_states.shape[2])
        if paged is not None:
            return self._publish_new_tokens(key_states, value_states, layer_idx, offset, kwargs, paged=paged)
        read = self.store.read(layer_idx, self._rows)
        step = LayerStep(self, layer_idx, read, offset, key_states.shape[2], self._identity[layer_idx])
        self._pending = step
        layer_step.publish(step, kwargs)
        return read.keys, read.values

    def _publish_new_tokens(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        offset: int,
        attention_kwargs: dict | None,
        *,
        sparse: bool = False,
        paged: PagedLayer | None = None,
        identity: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A call whose attention needs no dense read of the layer: a decode step of a
        page-retrieval strategy (``sparse``, ``quest``: the pages its query chooses,
        :meth:`read_chosen_pages`), a few tokens attending straight over the layer's pages
        (``paged``), or the first tokens of a layer that held none (a prefill: the layer is
        these tokens, at slots equal to their positions when ``identity``). The tokens are
        stored and nothing is read back. Returns the new tokens' keys and values."""
        batch, heads, tokens = key_states.shape[:3]
        positions = (offset + torch.arange(tokens, device=key_states.device)).expand(batch, heads, tokens).contiguous()
        valid = torch.ones(batch, heads, tokens, dtype=torch.bool, device=key_states.device)
        new_tokens = LayerRead(key_states, value_states, positions, valid)
        step = LayerStep(self, layer_idx, new_tokens, offset, tokens, identity, sparse=sparse, paged=paged)
        self._pending = step
        layer_step.publish(step, attention_kwargs)
        return key_states, value_states

    def _holds_nothing(self, layer_idx: int, key_states: torch.Tensor) -> bool:
        """Whether ``layer_idx`` holds no token of this batch yet (no prefix attached either) and
        stores ``key_states``' dtype, so that after the append it reads back exactly the call's
        own tensors (pools encode pages only once sealed, after attention)."""
        return (
            self._seen[layer_idx] == 0
            and key_states.dtype == self.store.dtype
            and not bool(self.store.physical_lengths(layer_idx, self._rows).any())
        )

    def _paged_layer(self, layer_idx: int, query_length: int) -> PagedLayer | None:
        """The layer's pages for attention straight over them (no dense copy; with tiering only
        the off-device pages are staged), when this call may use them: at most
        :data:`PAGED_QUERY_TOKENS` new tokens (decoding, assisted decoding's candidates; under
        eviction the compressor then reads what it needs itself, see :meth:`_stored_layer`), no read mirror asked for, a device the kernel runs on and
        a pool that gives its pages; else None."""
        if (
            self.read_cache
            or query_length > PAGED_QUERY_TOKENS
            or not reads_pages_in_place(self.store.device)
        ):
            return None
        return self.store.paged_layer(layer_idx, self._rows)

    def dense_step(self, step: LayerStep) -> LayerStep:
        """``step`` with the layer read back in dense form, for an attention function that
        cannot read pages (eager attention, attention sinks): a transient copy, not kept."""
        read = self.store.read(step.layer_idx, self._rows, mirror=False)
        return LayerStep(self, step.layer_idx, read, step.query_offset, step.query_length, self._identity[step.layer_idx])

    def choose_pages(self, layer_idx: int, query: torch.Tensor) -> torch.Tensor:
        """The pages of ``layer_idx`` the tiering strategy chooses for ``query`` (``[batch,
        query_heads, 1, head_dim]``, after RoPE): int64 ``[batch, kv_heads, k]`` indices into each
        head's block table, ``-1`` for none (CPU)."""
        key_min, key_max, pages_used = self.store.key_bounds(layer_idx, self._rows)
        return self.tiering.select_pages(query, key_min, key_max, pages_used)

    def chosen_pages(self, layer_idx: int, chosen: torch.Tensor) -> PagedLayer | None:
        """The ``chosen`` pages (:meth:`choose_pages`) where they lie, for attention straight over
        them; None where pages cannot be read in place (then :meth:`read_chosen_pages`)."""
        if not reads_pages_in_place(self.store.device):
            return None
        return self.store.paged_selection(layer_idx, self._rows, chosen)

    def read_chosen_pages(self, layer_idx: int, chosen: torch.Tensor) -> LayerRead:
        """The ``chosen`` pages (:meth:`choose_pages`), read sparsely into a dense copy."""
        return self.store.read_selected(layer_idx, self._rows, chosen)

    def _overwrite(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, attention_kwargs: dict | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` inside :meth:`recomputing`: the call's tokens are stored ones, rewritten."""
        positions = self._recompute
        self.store.overwrite(layer_idx, self._rows, positions, key_states, value_states)
        read = self.store.read(layer_idx, self._rows)
        step = LayerStep(self, layer_idx, read, self._seen[layer_idx], key_states.shape[2], False, positions.to(read.positions.device))
        self._pending = step
        layer_step.publish(step, attention_kwargs)
        return read.keys, read.values

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill this empty cache with precomputed keys (after RoPE) and values of every layer,
        ``[batch, kv_heads, tokens, dim]`` each, as tokens at positions ``0 .. tokens - 1``."""
        if self._rows or any(self._seen):
            raise ValueError("load needs an empty cache: call reset() first")
        if len(keys) != self.shape.num_layers or len(values) != self.shape.num_layers:
            raise ValueError(f"load takes keys and values for each of the {self.shape.num_layers} layers")
        if self.store is None:
            self.store = self._new_store(keys[0])
        self._rows.extend(self.store.new_sequence() for _ in range(keys[0].shape[0]))
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.store.append(layer, self._rows, k, v)
            self._seen[layer] = k.shape[2]
        self._padding = torch.zeros(keys[0].shape[0], dtype=torch.int64, device=self.store.device)

    @contextlib.contextmanager
    def recomputing(self, positions: torch.Tensor) -> Iterator[None]:
        """Forward calls inside recompute stored tokens at ``positions`` (int ``[tokens]``, ascending,
        the order of the call's inputs): each layer overwrites their keys and values with the new
        ones, and their queries attend causally by these positions (CacheBlend's selective
        recompute). Pass ``position_ids=positions[None]`` to the model."""
        if not self._rows:
            raise ValueError("recomputing needs a cache holding the tokens (load() or a prefill first)")
        self._recompute = torch.as_tensor(positions, dtype=torch.int64).cpu()
        try:
            yield
        finally:
            self._recompute = None

    def check_batch(self, batch: int) -> None:
        """``ValueError`` unless a batch of ``batch`` rows may use this cache (it is empty, or holds that many)."""
        if self._rows and batch != len(self._rows):
            raise ValueError(
                f"this cache holds a batch of {len(self._rows)} sequences but got a batch of {batch}; call cache.reset()"
                " before reusing it for another batch"
            )

    def after_attention(
        self,
        step: LayerStep,
        *,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        weights: torch.Tensor | None,
        real_new: torch.Tensor | None,
        scaling: float | None,
    ) -> None:
        """Called by the kvlib attention function once the layer's attention has run: records
        padding (counted per row, on the device), lets a fitted codec learn from the layer's first
        call, lets the compressor drop tokens, then seals the layer's full pages."""
        self._pending = None
        if step.layer_idx == 0 and real_new is not None:
            self._padding += (~real_new).sum(-1)  # stays on the device: no sync per step
        sealing = [step.layer_idx]
        read = step.read if step.paged is None else None  # the layer as stored, until a compaction changes it
        codec = self.codecs[step.layer_idx] if self.codecs is not None else None
        if codec is not None and codec.learns and not codec.ready:
            codec.observe(self._fit_sample(step, query, real_new))
            if codec.ready:  # a cross-layer fit readies earlier layers too
                sealing = list(range(step.layer_idx + 1))
        if self.compressor is not None:
            inputs = AttentionInputs(query, mask, weights, scaling, real_new, self._hidden_states.pop(step.layer_idx, None))
            stored = None if step.paged is None else (lambda: self.store.read(step.layer_idx, self._rows, mirror=False))
            compaction = self.compressor.compaction(self._stored_layer(step), inputs, self._padding, stored)
            if compaction is not None:
                layout = self.store.compact(step.layer_idx, self._rows, compaction.keep, compaction.values, reuse_slots=self.reuse_slots)
                self.compressor.compacted(step.layer_idx, layout)
                self._identity[step.layer_idx] = False
                read = None
        if self.codecs is not None:
            for layer in sealing:
                self.store.seal(layer, self._rows)
        if self.tiering is not None and not step.sparse and self.tiering.refreshes_ranking(self._seen[step.layer_idx], step.query_length):
            self._rank_pages(step.layer_idx, read if read is not None else self.store.read(step.layer_idx, self._rows))
        if self._session is not None and step.layer_idx == self.shape.num_layers - 1:
            self._session.index(self._seen[step.layer_idx])

    def _stored_layer(self, step: LayerStep) -> LayerStep:
        """``step`` as the compressor sees it: the layer's stored tokens after the call's append.
        A call that attended over the pages (``step.paged``) read none of them: it gets their
        positions (:meth:`PagedStore.read_positions`; attention weights come from the pages), and
        the compressor reads keys and values into a transient dense copy only when it compacts
        with a strategy that scores with them (``reads_kv``)."""
        if step.paged is None:
            return step
        return dataclasses.replace(step, read=self.store.read_positions(step.layer_idx, self._rows))

    def _rank_pages(self, layer_idx: int, read: LayerRead) -> None:
        """Re-rank ``layer_idx``'s pages for the device tier by the tiering strategy's scores of its
        stored tokens ``read`` (the layer as it now stands; padding never counts)."""
        padding = self._padding.to(read.positions.device).view(-1, 1, 1)
        real = read.valid & (read.positions >= padding)
        view = LayerView(layer_idx, self.shape.num_layers, read.keys, read.values, torch.where(real, read.positions - padding, -1), real)
        self.store.rank_pages(layer_idx, self._rows, self.tiering.ranking_scores(view))

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
        if self._rows or any(self._seen):
            raise ValueError("prime needs an empty cache: call reset() first")
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype.is_floating_point or prompt.shape[1] < 1:
            raise ValueError("prompt must be an integer tensor [batch, tokens] with at least one token")
        if attention_mask is not None and not bool(attention_mask.all()):
            return 0
        dtype, device = self.home
        self.store = self._shared_store(dtype, device)
        namespace = self.reuse.namespace(self.spec, dtype, device, self.page_size)
        self._session = PrefixSession.start(self, self.reuse, namespace, self.store, self._rows, prompt.cpu(), prompt.shape[0])
        reused = self._session.reused_tokens
        self._seen = [reused] * self.shape.num_layers
        self._padding = torch.zeros(prompt.shape[0], dtype=torch.int64, device=self.store.device)
        return reused

    def index_tokens(self, tokens: torch.Tensor) -> None:
        """Index, in the cache's PrefixStore, the full pages of ``tokens`` (int ``[batch, n]``: the
        prompt the cache was primed with, then what it generated, as ``generate`` returns them), so
        that the next turn of a conversation reuses the answer too. Only tokens the cache holds
        count (the last generated token has no KV yet)."""
        if self._session is None or not self._session.blocks or self.reuse is None:
            raise ValueError("index_tokens needs a cache primed from a PrefixStore (make_cache(reuse=..., prompt=...))")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError("tokens must be an integer tensor [batch, tokens]")
        self._session.extend(tokens.cpu(), min(self._seen))

    def _fit_sample(self, step: LayerStep, query: torch.Tensor, real_new: torch.Tensor | None) -> FitSample:
        """The layer's stored tokens and this call's queries, padding marked invalid."""
        read = step.read
        real = read.valid & (read.positions >= self._padding.view(-1, 1, 1))
        query_valid = real_new if real_new is not None else torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
        return FitSample(step.layer_idx, read.keys, read.values, real, query, query_valid)

    def record_hidden_states(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """Keep a layer's attention input for a strategy that needs ``hidden_states``."""
        if self.compressor is not None and "hidden_states" in self.compressor.strategy.needs:
            self._hidden_states[layer_idx] = hidden_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (logical length, padding included) by ``layer_idx``."""
        return self._seen[layer_idx]

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Masks span every logical position (kv length = seen + new, offset 0)."""
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first update."""
        return len(self._rows) or -1

    # -- batch operations -----------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every stored token (pages go back to the pool); the next update starts a new batch."""
        if self._session is not None:  # the store is the PrefixStore's: give back what this cache held
            self._session.close()
            self._session = None
        elif self.codecs is not None:  # fitted codecs belong to the old prompt: start a new store
            self.store = self.codecs = None
        elif self._rows:
            self.store.release(self._rows)
            self.store.peak_page_bytes = self.store.memory_bytes()["pages"]
        self._rows.clear()
        self._padding = torch.zeros(0, dtype=torch.int64)
        self._identity = [True] * self.shape.num_layers
        self._seen = [0] * self.shape.num_layers
        self._pending = None
        self._hidden_states.clear()
        if self.compressor is not None:
            self.compressor.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of old row ``beam_idx[i]`` (beam search)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place (``[a, b] -> [a, a, b, b]``)."""
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self._select_rows(torch.arange(max(len(self._rows), 0)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows at ``indices`` (in that order; repeats allowed)."""
        self._select_rows(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens seen (``tokens_to_remove <= 0``, as in ``DynamicCache``).

        Rolling back is exact for the tokens themselves; tokens an eviction already dropped to
        make room for them stay dropped (``is_croppable`` is False when the spec evicts).
        """
        if not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative int, the number of tokens to remove (0 does nothing); got {tokens_to_remove!r}"
            )
        if tokens_to_remove == 0 or not self._rows:
            return
        for layer in range(self.shape.num_layers):
            length = max(self._seen[layer] + tokens_to_remove, 0)
            if self.compressor is not None:  # the tokens to forget may sit in reused slots, not at the end
                self._forget_from(layer, length)
            self.store.truncate(layer, self._rows, length)
            self._seen[layer] = min(self._seen[layer], length)

    def _forget_from(self, layer: int, length: int) -> None:
        """Drop the stored tokens of ``layer`` at positions ``>= length`` wherever they sit (a
        compaction that may reuse slots); the compressor's per-slot state follows."""
        positions = self.store.stored_positions(layer, self._rows)
        slot = torch.arange(positions.shape[-1])
        keep = torch.where((positions >= 0) & (positions < length), slot, -1)
        self.compressor.compacted(layer, self.store.compact(layer, self._rows, keep, reuse_slots=self.reuse_slots))

    def _select_rows(self, index: torch.Tensor) -> None:
        if not self._rows:
            return
        index = torch.as_tensor(index).to("cpu", torch.int64).flatten()
        if bool(((index < 0) | (index >= len(self._rows))).any()):
            raise ValueError(f"row indices must be in [0, {len(self._rows)}), got {index.tolist()}")
        if index.tolist() == list(range(len(self._rows))):
            return
        old = list(self._rows)
        self._rows[:] = [self.store.fork(old[i]) for i in index.tolist()]  # in place: a prefix session shares the list
        self.store.release(old)
        self._padding = self._padding[index.to(self._padding.device)]
        if self.compressor is not None:
            self.compressor.select_rows(index)

    # -- inspection -----------------------------------------------------------------------------

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Original positions of the tokens ``layer_idx`` stores: int64 ``[batch, kv_heads, max_kept]``,
        ascending (whatever slots hold them), padded with -1 (CPU).

        Positions count from each row's first real token (left padding excluded), as if the
        row had been run alone.
        """
        self._check_layer(layer_idx)
        if not self._rows:
            raise ValueError("the cache holds no tokens yet: run the model with it first")
        stored = self.store.stored_positions(layer_idx, self._rows)
        positions = stored - self._padding.cpu().view(-1, 1, 1)
        real = (stored >= 0) & (positions >= 0)
        past_end = torch.iinfo(torch.int64).max
        kept = torch.sort(torch.where(real, positions, past_end), dim=-1).values
        return torch.where(kept == past_end, -1, kept)[..., : int(real.sum(-1).max())]

    def memory_report(self) -> dict:
        """Bytes this cache holds, and what a full cache in the compute dtype would hold.

        Keys: ``total_bytes``; ``by_tier`` (``device``: the store's device, ``host``, ``disk``);
        ``by_component`` (``pages``: keys and values of pages in use, ``positions``,
        ``codec_metadata``, ``tables``: block tables and lengths, ``read_cache``: the dense read
        mirror); ``reserved_bytes``: whole arenas, free pages included; ``peak_pages_bytes``: the
        most ``pages`` bytes held at any moment since the store was created (between a layer's
        append and its compaction included: the peak of a prefill); ``peak_workspace_bytes``: the
        largest transient dense copy of a layer a call attended over (prefill, chunks; not held
        after the call, so not in ``total_bytes``); ``full_equivalent_bytes``:
        keys and values of every logical token of every layer, uncompressed; ``stored_tokens`` and
        ``logical_tokens``, summed over layers, rows and KV heads.
        """
        components = {"pages": 0, "positions": 0, "codec_metadata": 0, "tables": 0, "read_cache": 0}
        host = disk = 0
        report = {"reserved_bytes": 0, "peak_pages_bytes": 0, "peak_workspace_bytes": 0, "full_equivalent_bytes": 0, "stored_tokens": 0, "logical_tokens": 0}
        if self.store is not None:
            held = self.store.memory_bytes()
            for name in ("pages", "positions", "codec_metadata", "tables", "read_cache"):
                components[name] = held[name]
            report["reserved_bytes"] = held["reserved"]
            host, disk = held["host"], held["disk"]
            report["peak_pages_bytes"] = self.store.peak_page_bytes
            report["peak_workspace_bytes"] = self.store.peak_workspace
        if self._rows:
            shape = self.shape
            for layer in range(shape.num_layers):
                report["stored_tokens"] += int(self.store.physical_lengths(layer, self._rows).sum())
                report["logical_tokens"] += int(self.store.logical_lengths(layer, self._rows).sum()) * shape.num_kv_heads
            element = torch.empty((), dtype=self.store.dtype).element_size()
            report["full_equivalent_bytes"] = report["logical_tokens"] * (shape.head_dim + shape.value_dim) * element
        total = sum(components.values())
        by_tier = {"device": total - host - disk, "host": host, "disk": disk}
        return {"total_bytes": total, "by_tier": by_tier, "by_component": components, **report}

    # -- helpers --------------------------------------------------------------------------------

    def _new_store(self, key_states: torch.Tensor) -> PagedStore:
        if self.reuse is not None:  # unprimed: live in the PrefixStore's store, index nothing
            return self._shared_store(key_states.dtype, key_states.device)
        return self._build_store(key_states.dtype, key_states.device)

    def _shared_store(self, dtype: torch.dtype, device: torch.device) -> PagedStore:
        """The PrefixStore's paged store for this cache's namespace (its codecs are the store's)."""
        namespace = self.reuse.namespace(self.spec, dtype, device, self.page_size)
        store = self.reuse.paged_store(namespace, lambda: self._build_store(dtype, device))
        if self.codec is not None:
            self.codecs = [getattr(pool, "codec", None) for pool in store.pools]
        return store

    def _build_store(self, dtype: torch.dtype, device: torch.device) -> PagedStore:
        shape = self.shape
        if self.codec is not None:
            self.codecs = self.codec.layer_codecs(
                layer_shapes(
                    shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.value_dim, self.page_size,
                    dtype, device,
                )
            )
        disk_tier = self._disk_tier(dtype)
        config = StoreConfig(
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            value_dim=shape.value_dim,
            page_size=self.page_size,
            dtype=dtype,
            device=device,
            read_cache=self.read_cache,
            codecs=self.codecs,
            device_pages=self._device_pages(dtype),
            host_pages=self._host_pages(dtype),
            key_summaries=self.tiering is not None and self.tiering.key_summaries,
            disk_pages=disk_tier.get("disk_pages", 0),
            placement=self.tiering,
        )
        prefetch = self.tiering is not None and self.tiering.prefetches()
        return PagedStore(config, spill=disk_tier.get("spill"), prefetcher=PagePrefetcher(config.device) if prefetch else None)

    def _page_bytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.page_size * (self.shape.head_dim + self.shape.value_dim) * element

    def _device_pages(self, dtype: torch.dtype) -> int | None:
        """Pages per layer the tiering strategy keeps on the device (None: no tiering)."""
        return None if self.tiering is None else self.tiering.device_pages(self.shape.num_layers, self._page_bytes(dtype))

    def _host_pages(self, dtype: torch.dtype) -> int | None:
        """Pages per layer the tiering strategy allows on the host (None: unbounded)."""
        return None if self.tiering is None else self.tiering.host_pages(self.shape.num_layers, self._page_bytes(dtype))

    def _disk_tier(self, dtype: torch.dtype) -> dict:
        """The store's ``spill`` and ``disk_pages`` when the tiering strategy names a disk (the
        spill store opened once per cache)."""
        if self.tiering is None or not self.tiering.disk_directory():
            return {}
        shape = self.shape
        layout = Layout(bytes(16), 1, 1, self.page_size, shape.head_dim, shape.value_dim, dtype)
        disk_pages = self.tiering.disk_pages(shape.num_layers, record_size(layout))
        if self.spill is None:
            self.spill = SpillStore(self._spill_tier, capacity_bytes=disk_pages * shape.num_layers * record_size(layout))
        return {"spill": self.spill, "disk_pages": disk_pages}

    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.shape.num_layers:
            raise ValueError(f"layer_idx must be an int in [0, {self.shape.num_layers}), got {layer_idx!r}")

    def __repr__(self) -> str:
        spec = "exact" if self.compressor is None else f"{self.compressor.strategy.spec()}, budget={self.compressor.budget}"
        if self.codec is not None:
            spec += f", codec={self.codec.spec()}"
        return f"KVCache({spec}, layers={self.shape.num_layers}, batch={len(self._rows)})"


def _spill_tier(tiering: Tiering | None) -> DiskTier | None:
    """The disk tier of the directory ``tiering`` spills to (None: it spills nowhere), opened
    now: a directory that cannot hold one is refused before any model work, as a ``ValueError``."""
    if tiering is None or not tiering.disk_directory():
        return None
    try:
        return open_disk_tier(tiering.disk_directory(), capacity_bytes=1)
    except DiskTierUnavailable as error:
        raise ValueError(f"{tiering.spec()}: {error}; spilled pages need a disk tier: name a writable directory, "
                         "or drop disk= to keep pages in host memory only") from None
