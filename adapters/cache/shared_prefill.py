"""One prompt call, many caches: record what a prompt call gives each layer's after-attention
work, then replay it into other caches as if each had run the call itself.

A cache's first model call (the prompt, not chunked) attends over exactly the call's own keys and
values whatever the cache does afterwards: eviction, codec fits and sealing all run after the
layer's attention (:meth:`~kvlib.adapters.cache.cache_layer.KVCacheLayer.after_attention`), so
the call's outputs (logits, every layer's hidden states, keys and values) are the same for an
exact cache and for one that compresses. A comparison of many configurations can therefore run the
prompt once, through an exact ``source`` cache carrying a :class:`PrefillRecorder`, and give each
configuration's cache the prompt by :func:`replay`: layer by layer, the source's keys and values go
through the cache's own ``update`` (the same append a separate run makes) and the recorded
after-attention inputs through its own ``after_attention``, in layer order. The cache's store,
evictor state (accumulated attention, query history, call notes), codec fits and padding then
equal those of a separate run of the same call, token for token. What a replay computes from the
call alone (the attention a policy accumulates from it) is kept in the recorder's ``memo`` and
reused by the caches replayed after it, once per policy and layer. A sliding-window layer
(Gemma 3's local layers) that the call took past its window frees what left the window once
attention has run; the recorder keeps its keys and values as the call stored them, so a replay
gets the whole prompt, as a separate run would.

What is recorded is what the caches to be replayed need (:func:`prefill_needs`): each layer's
mask (one tensor shared by the layers, kept once), real new tokens and softmax scale always; its
queries (``[batch, query_heads, tokens, head_dim]``, the compute dtype) only for a policy that
reads them (scores, attention, history) or a codec that learns from them; the attention module's
input only for a policy that needs ``hidden_states``. Attention weights are never recorded:
a prompt call that returned them (eager attention) cannot be replayed for a policy that reads
attention (:meth:`PrefillRecorder.observe` refuses).

Caches that cannot take a replay (:func:`sharing_refusal`): tiering (its placement and spilled
pages follow the calls), a prefix store (its session owns the rows), a recompute policy (its
layers store the attention input, not the keys and values), a cache that already holds
tokens, and an eviction policy that declares it does not share a prefill
(:attr:`~kvlib.policy.Eviction.shares_prefill`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.needs import AttentionInputs
from kvlib.storage.layers.read_cache import LayerRead

QUERY_NEEDS = frozenset({"queries", "window_queries", "recent_queries", "prompt_length", "attention", "accumulated_attention"})
"""Policy needs that read the prompt call's queries (directly, or to compute attention)."""
ATTENTION_NEEDS = frozenset({"attention", "accumulated_attention"})
"""Policy needs that read attention weights (returned by eager attention when it ran)."""


@dataclass(frozen=True)
class PrefillNeeds:
    """What a replay needs recorded beyond masks: ``queries`` and ``hidden_states`` per layer;
    ``attention``: whether the replayed policy reads attention weights (see :data:`ATTENTION_NEEDS`)."""

    queries: bool = False
    hidden_states: bool = False
    attention: bool = False

    def __or__(self, other: PrefillNeeds) -> PrefillNeeds:
        return PrefillNeeds(self.queries or other.queries, self.hidden_states or other.hidden_states, self.attention or other.attention)


def prefill_needs(cache: KVCache) -> PrefillNeeds:
    """What replaying a prompt call into ``cache`` needs recorded (its policy's and codec's needs)."""
    needs = frozenset() if cache.evictor is None else cache.evictor.policy.needs
    learns = cache.codec is not None and _codec_reads_queries(cache)
    return PrefillNeeds(bool(needs & QUERY_NEEDS) or learns, "hidden_states" in needs, bool(needs & ATTENTION_NEEDS))


def _codec_reads_queries(cache: KVCache) -> bool:
    """Whether the cache's codec learns from the prompt (its fit sees the queries) or reads the
    evictor's salience (which may score with them). Before the store exists, a codec is assumed to."""
    codecs = cache.codecs
    if codecs is None:
        return True
    return any(codec is not None and (codec.learns or codec.uses_salience) for codec in codecs)


def sharing_refusal(cache: KVCache) -> str | None:
    """Why ``cache`` cannot take a replayed prompt call (one line), or None when it can."""
    if cache.tiering is not None:
        return f"tiering ({cache.tiering.spec()}) places pages as the calls run"
    if cache.reuse is not None:
        return "a prefix store's session owns the cache's rows"
    if cache.projections is not None:
        return "its layers store the attention input (checkpoints), which a replayed call's keys and values do not give"
    if cache.rows or any(layer.seen for layer in cache.kv_layers):
        return "the cache already holds tokens"
    if cache.evictor is not None and not cache.evictor.policy.shares_prefill:
        return f"{cache.evictor.policy.spec()} does not share a prefill (shares_prefill = False)"
    return None


@dataclass
class LayerCall:
    """What one layer's after-attention work got from the prompt call (references, no copies):
    ``query`` None where no replay reads it (then only its ``query_shape`` is kept); ``stored``:
    the layer's keys and values after the call's append, kept only for a sliding-window layer that
    the call took past its window (the source then frees what left the window, a replay needs all)."""

    query: torch.Tensor | None
    query_shape: torch.Size
    mask: torch.Tensor | None
    real_new: torch.Tensor | None
    scaling: float | None
    hidden_states: torch.Tensor | None = None
    stored: LayerRead | None = None


@dataclass
class PrefillRecorder:
    """Records, for every layer of a source cache's prompt call, the after-attention inputs that
    ``needs`` asks for (see the module docstring). Attach it with :func:`recording`."""

    needs: PrefillNeeds
    calls: dict[int, LayerCall] = field(default_factory=dict)
    memo: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    """What the replays computed from the recorded call, for the replays after them
    (:attr:`~kvlib.adapters.runtime.needs.AttentionInputs.prompt_memo`)."""
    _hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def hidden(self, layer: int, hidden_states: torch.Tensor) -> None:
        """The attention module's input of ``layer`` (kept where a replay needs it)."""
        if self.needs.hidden_states:
            self._hidden[layer] = hidden_states

    def observe(self, layer: int, step: LayerStep, *, inputs: AttentionInputs, stored: LayerRead | None = None) -> None:
        """The inputs of ``layer``'s after-attention work in the prompt call (``inputs``: what its
        attention saw; ``stored``: see :class:`LayerCall`). Raises ``RuntimeError`` for a call that
        is not a first, whole prompt call (the layer held tokens before it), or one whose attention
        returned weights that a replayed policy reads."""
        if layer in self.calls or step.query_offset != 0:
            raise RuntimeError("a shared prefill records one prompt call into an empty cache; this call is not one")
        if inputs.weights is not None and self.needs.attention:
            raise RuntimeError("the prompt call's attention returned weights (eager attention): a replay cannot recompute them")
        query = inputs.query
        kept = query if self.needs.queries else None
        self.calls[layer] = LayerCall(
            kept, query.shape, inputs.mask, inputs.real_new, inputs.scaling, self._hidden.pop(layer, None), stored
        )

    def call(self, layer: int) -> LayerCall:
        """``layer``'s recorded call (``RuntimeError`` where the prompt call never reached it)."""
        recorded = self.calls.get(layer)
        if recorded is None:
            raise RuntimeError(f"layer {layer}'s prompt call was not recorded (did it run through kvlib?)")
        return recorded


@contextlib.contextmanager
def recording(source: KVCache, recorder: PrefillRecorder) -> Iterator[PrefillRecorder]:
    """Attach ``recorder`` to every layer of ``source`` (an empty exact cache) for the calls inside."""
    if source.evictor is not None or source.codec is not None or source.tiering is not None:
        raise ValueError("a shared prefill's source is an exact cache (kvlib.make_cache(model)): no policy")
    for layer in source.kv_layers:
        layer.recorder = recorder
    try:
        yield recorder
    finally:
        for layer in source.kv_layers:
            layer.recorder = None


def replay(cache: KVCache, source: KVCache, recorder: PrefillRecorder) -> None:
    """Give the empty ``cache`` the prompt call ``source`` ran while ``recorder`` recorded it, as
    if ``cache`` had run the call itself (see the module docstring); ``cache`` must take it
    (:func:`sharing_refusal` None) and its needs must be within the recorder's."""
    refusal = sharing_refusal(cache)
    if refusal is not None:
        raise ValueError(f"this cache cannot take a shared prefill: {refusal}")
    needs = prefill_needs(cache)
    if (needs.queries and not recorder.needs.queries) or (needs.hidden_states and not recorder.needs.hidden_states):
        raise ValueError(f"the shared prefill recorded {recorder.needs}, this cache needs {needs}")
    rows = source.rows
    for layer in cache.kv_layers:
        recorded = recorder.call(layer.layer_idx)
        read = recorded.stored if recorded.stored is not None else source.store.read(layer.layer_idx, rows, mirror=False)
        tokens = source.kv_layers[layer.layer_idx].seen
        if read.keys.shape[2] != tokens or not bool(read.valid.all()):
            raise RuntimeError("the shared prefill's source must hold its whole prompt, in position order")
        if recorded.hidden_states is not None:
            cache.record_hidden_states(layer.module_layer, recorded.hidden_states)
        layer.update(read.keys, read.values, kwargs={})  # publishes into the dict: no attention will take it
        query = recorded.query if recorded.query is not None else read.keys.new_zeros(()).expand(recorded.query_shape)
        inputs = AttentionInputs(query, recorded.mask, None, recorded.scaling, recorded.real_new, prompt_memo=recorder.memo)
        layer.after_attention(layer.pending, inputs)
