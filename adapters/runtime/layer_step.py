"""The one hand-off between a cache's ``update`` and the kvlib attention function of the same layer call.

A `transformers` attention layer calls ``cache.update(k, v, layer_idx)`` and then, at once, its
attention function with the tensors ``update`` returned. The cache layer publishes a step (a
:class:`Step`: :class:`LayerStep` for a :class:`~kvlib.adapters.KVCache`,
:class:`~kvlib.adapters.engine.packed_batch.PackedLayerStep` for the engine's packed batch) that the
kvlib attention function of the same call takes back and runs (:meth:`Step.attend`):

- from transformers 5.24 on, attention layers pass their attention keyword arguments to the
  cache (``update(k, v, layer_idx, kwargs=attention_kwargs)``) and then the same dict to the
  attention function (as transformers' own paged cache hands its block table over): the step
  travels in that dict under :data:`STEP_KEYWORD`, from one call to the same call's attention;
- otherwise (older releases, models that pass no kwargs) it waits in a context variable, so
  threads and async tasks never see each other's steps.

Either way a step is taken only by the attention call it is for (same layer, and the key tensor
object ``update`` returned), at most once. Attention over anything else (another cache class,
cross-attention) finds no step and runs unchanged. Data flows one way: ``update`` -> step ->
attention -> the step's after-attention work (eviction, sealing, ranking, prefix indexing).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch

from kvlib.kernels.pages import PagedLayer
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.step_plan import StepPlan


class AttentionPath(enum.Enum):
    """Where an attention call's math runs (:meth:`AttentionCall.path` chooses)."""

    PLANNED = "planned"
    """Through the decode step's plan: one decode operator over the pages the plan wrote."""
    OVER_PAGES = "over pages"
    """Straight over pages where they lie (the page kernel with the step's block table)."""
    DENSE = "dense"
    """Over a dense read of the stored tokens, through the inner attention (or its math)."""


@dataclass(kw_only=True)
class AttentionCall:
    """One call of a kvlib attention function, as the step attending it sees it.

    ``query [batch, query_heads, queries, head_dim]`` (after RoPE), ``key`` and ``value``: what the
    cache's ``update`` returned; ``attention_mask``: the model's mask over logical positions, or
    None (SDPA's causal shortcut); ``inner``: the SDPA or eager attention function doing the math
    (``eager`` tells which: eager takes an additive float mask); ``kwargs``: the attention keyword
    arguments (``scaling``, ``softcap``, ``s_aux``, ``dropout``...), the step's keyword removed."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    inner: Callable
    eager: bool
    kwargs: dict

    @property
    def float_mask_dtype(self) -> torch.dtype | None:
        """The dtype of the additive float mask the inner attention takes over stored slots (the
        model's float mask's, or the query's for eager attention), or None for a bool mask."""
        mask = self.attention_mask
        if mask is not None and mask.dtype != torch.bool:
            return mask.dtype
        return self.query.dtype if self.eager else None

    @property
    def reads_pages(self) -> bool:
        """Whether a paged kernel reproduces this call's attention: SDPA as the inner function
        (:func:`paged_attention_applies` to its keyword arguments), not eager attention."""
        return not self.eager and paged_attention_applies(self.kwargs)

    def path(self, planned: bool, over_pages: bool) -> AttentionPath:
        """The one rule choosing where this call's attention runs, for the drop-in cache's layers
        and the engine's packed batch alike: through the plan where the step was planned, else over
        pages where the step holds them in place (``over_pages``), when a paged kernel reproduces
        the call (:attr:`reads_pages`); densely otherwise."""
        if not self.reads_pages:
            return AttentionPath.DENSE
        if planned:
            return AttentionPath.PLANNED
        return AttentionPath.OVER_PAGES if over_pages else AttentionPath.DENSE

    @property
    def module_key(self) -> int:
        """The int naming :attr:`module` for the operators of a compiled forward (:func:`module_key`)."""
        return module_key(self.module)

    def run_inner(self, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inner attention of ``query`` over ``key`` and ``value`` with ``mask``."""
        return self.inner(self.module, self.query, key, value, mask, **self.kwargs)


def module_key(module: torch.nn.Module) -> int:
    """The int naming an attention module of a routed model for the operators of a compiled
    forward (:func:`~kvlib.adapters.runtime.attention.attention_module` gives it back)."""
    return id(module)


def paged_attention_applies(kwargs: dict) -> bool:
    """Whether SDPA with these attention kwargs is plain attention the page kernel reproduces:
    no attention sinks (``s_aux``) and no dropout (training)."""
    return kwargs.get("s_aux") is None and not kwargs.get("dropout")


class Step(Protocol):
    """What a cache layer publishes for the attention call of the same layer call."""

    layer_idx: int

    def is_for(self, module: torch.nn.Module, keys: torch.Tensor) -> bool:
        """Whether the attention call of ``module`` over ``keys`` is the one this step was published for."""
        ...

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output (``[batch, queries, query_heads, value_dim]``) and weights (or None),
        then the step's after-attention work."""
        ...


class StepOwner(Protocol):
    """The cache layer that stored a :class:`LayerStep`: it attends over its own tokens and then
    does the work that follows attention (see :class:`~kvlib.adapters.cache.cache_layer.KVCacheLayer`).
    ``module_layer``: the ``layer_idx`` of the attention module its steps are for."""

    module_layer: int | None

    def attend(self, step: LayerStep, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def attend_returned(self, returned: ReturnedTokens, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class LayerStep:
    """One layer call of a :class:`~kvlib.adapters.KVCache`: the tokens attention will run over and
    how they map to positions.

    Attributes:
        owner: the cache layer that stored the step (None for a step built only to score a
            compaction, as the engine does: such a step is never published).
        layer_idx: the attention layer.
        read: the layer's stored tokens after the append (physical slots, KV heads).
        query_offset: logical position of the first new token (tokens seen before this call).
        query_length: new tokens in this call (the query length).
        identity: every stored token of every row and head sits at the slot equal to its
            logical position (nothing was ever dropped), so the model's mask applies as it is.
        query_positions: int64 ``[query_length]``, the true positions of a call whose queries
            are scattered tokens already stored (a selective recompute); each attends to the
            stored tokens at or before its position, and the model's mask is not used. None
            for an ordinary call (queries at ``query_offset + i``).
        sparse: a decode step whose attention reads only the pages it chooses by the query
            (``quest``): ``read`` then holds just the call's new tokens (what ``update``
            returned), and attention asks the owner for the chosen pages.
        paged: the layer's tokens where they lie in the pages, for a call whose attention runs
            straight over them (:mod:`~kvlib.kernels.paged_attention`); ``read`` then holds just the
            call's new tokens (what ``update`` returned), and no dense copy of the layer exists.
        plan: the decode step's plan (:mod:`~kvlib.storage.store.step_plan`), for a call whose tokens were
            written where it said and whose attention runs over the pages through it; ``read``
            then holds just the call's new keys and values (positions and validity None).
    """

    owner: StepOwner | None
    layer_idx: int
    read: LayerRead
    query_offset: int
    query_length: int
    identity: bool
    query_positions: torch.Tensor | None = None
    sparse: bool = False
    paged: PagedLayer | None = None
    plan: StepPlan | None = None
    attended: bool = False
    """Whether an attention call took the step already (its after-attention work has run)."""

    @property
    def complete(self) -> bool:
        """Whether :attr:`read` holds every token the layer stores (a dense read, or a prefill's
        own tokens), not just the call's new ones (a planned, paged or sparse step)."""
        return self.plan is None and self.paged is None and not self.sparse

    def is_for(self, module: torch.nn.Module, keys: torch.Tensor) -> bool:
        """Whether the attention call of ``module`` is this layer's (over whatever keys: the
        step checks what it is handed when it attends)."""
        return getattr(module, "layer_idx", None) == self.owner.module_layer

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.attended:  # a second attention call of one layer call (DiffLlama attends twice)
            return self.returned().attend(call)
        return self.owner.attend(self, call)

    def returned(self) -> ReturnedTokens:
        """What another attention call over what this step returned needs (:class:`ReturnedTokens`)."""
        read = self.read
        return ReturnedTokens(
            self.owner, self.layer_idx, read.positions, read.valid, self.identity, self.query_offset, self.query_length, self.complete
        )


@dataclass(frozen=True)
class ReturnedTokens:
    """What a layer call's ``update`` returned, as another attention call over it needs it once
    the layer's own call has attended: a second call of the same layer (DiffLlama's two halves of
    the values), or a layer sharing another's keys and values (Gemma 3n's KV sharing). The keys
    and values themselves are what the call is handed; this holds their stored positions
    (``positions``, ``valid``: int64 / bool ``[batch, kv_heads, slots]``, None for a step that
    returned only its new tokens, ``complete`` False), whether slots equal positions and the
    query span, for the model's mask to be moved onto the slots. Such a call runs no
    after-attention work."""

    owner: StepOwner
    layer_idx: int
    positions: torch.Tensor | None
    valid: torch.Tensor | None
    identity: bool
    query_offset: int
    query_length: int
    complete: bool

    def is_for(self, module: torch.nn.Module, keys: torch.Tensor) -> bool:
        return True

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.owner.attend_returned(self, call)


_returned: dict[int, tuple[weakref.ref, ReturnedTokens]] = {}
"""Keys tensors ``update`` returned with every token of their layer, by ``id``, while the model
holds them (a weak reference each, whose callback drops the entry with its tensor), for
attention calls of layers that did not store them. (A ``WeakKeyDictionary`` would compare two
tensors with ``==``.)"""


def remember_returned(step: LayerStep) -> None:
    """Let attention calls of other layers over ``step``'s returned keys find it (:func:`take`);
    for a complete step only (what any other use of the keys can be correct over)."""
    keys = step.read.keys
    number = id(keys)
    _returned[number] = (weakref.ref(keys, lambda _, number=number: _returned.pop(number, None)), step.returned())


def _returned_over(keys: torch.Tensor) -> ReturnedTokens | None:
    entry = _returned.get(id(keys))
    return entry[1] if entry is not None and entry[0]() is keys else None


STEP_KEYWORD = "kvlib_layer_step"
"""The attention keyword argument that carries a step from ``update`` to attention (5.24+)."""

_active_step: ContextVar[Step | None] = ContextVar("kvlib_active_step", default=None)


def publish(step: Step, attention_kwargs: dict | None = None) -> None:
    """Make ``step`` the one the attention call of its layer takes: put it in the layer call's
    ``attention_kwargs`` when the model passed them to ``update``, else in the context variable."""
    if attention_kwargs is not None:
        attention_kwargs[STEP_KEYWORD] = step
    else:
        _active_step.set(step)


def take(module: torch.nn.Module, keys: torch.Tensor, attention_kwargs: dict) -> Step | None:
    """The step for this attention call, or None if it is not over a kvlib layer's tokens; removes
    :data:`STEP_KEYWORD` from ``attention_kwargs`` (the inner attention never sees it).

    The step published by the same layer call's ``update``; else, where ``keys`` are what a layer
    of a cache returned with every token of that layer (another layer sharing them, or a second
    call of the same layer after the step was taken), a :class:`ReturnedTokens`. A step published
    in the context variable is taken once.
    """
    step = attention_kwargs.pop(STEP_KEYWORD, None)
    if step is None:
        if torch.compiler.is_compiling():  # a traced update publishes in the keyword arguments only
            return None
        step = _active_step.get()
        if step is not None:
            _active_step.set(None)
    if step is not None and step.is_for(module, keys):
        return step
    return None if torch.compiler.is_compiling() else _returned_over(keys)
