"""KVzip: keep what the model needs to reconstruct its context (query-agnostic)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlib.policies.budget.adaptive import Adaptive
from kvlib.policies.eviction.measured_prefill import empty_cache_policy, prefill_measured
from kvlib.policy import Budget, ContextPrefill, Eviction, LayerView
from kvlib.registry import register

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
"""KVzip's reconstruction instructions (the official code's and kvpress's): for the first chunk,
and for later chunks (followed by the previous chunk's last tokens)."""


@register("kvzip")
@dataclass
class KVzip(Eviction):
    """KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction").

    A KV pair matters if the model needs it to reproduce its context. :func:`compress` prefills a
    context, then runs the model on a reconstruction prompt per chunk of ``chunk`` context tokens
    (``"Repeat the previous context exactly."``, the chat template's turn change, the chunk), and
    scores each context token of each KV head by the largest attention it receives from those
    queries, over the queries of the KV group (kvpress's ``KVzipPress``: the softmax is taken over
    the first ``sinks`` tokens, the chunk and the reconstruction prompt only). The first ``sinks``
    tokens always stay. The cache then keeps its budget by these scores (default allocation:
    ``adaptive(floor=0)``, one top-k across the heads of each layer, as kvpress's
    ``layerwise=True``; kvpress's default ranks across layers too). The scores do not depend on
    any question, so the compressed cache serves every later question (copies of it share pages).

    Used as a plain policy (``make_cache(model, "kvzip", budget=...)``, the Engine, ``kvlib
    compare``), with no reconstruction pass, each call's own queries play the reconstruction
    queries: a token scores the largest attention any later query of the call gives it (its own
    query excluded), max over the KV group; decode steps score by the one new query. That is
    KVzip's rule on the text at hand, not KVzip: only :func:`compress` runs the reconstruction,
    and :meth:`context_prefill` hands it to protocols that read a context before its questions
    (``kvlib compare --context-first``).

    Args:
        sinks: initial tokens always kept (kvpress's ``n_sink``, 4).
        chunk: context tokens per reconstruction chunk (kvpress's 2048).
    """

    sinks: int = 4
    chunk: int = 2048
    measured: list[torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    """Set by :func:`compress` while it prefills: per layer, float32 ``[batch, kv_heads, tokens]``
    reconstruction scores by position."""
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})
    reads_kv: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0 (tokens), got {self.sinks}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 (tokens), got {self.chunk}")

    def default_budget(self) -> Budget:
        return Adaptive(floor=0.0)

    def context_prefill(self) -> ContextPrefill:
        """:func:`compress`, with the reconstruction prompt of the tokenizer's chat template."""
        return prefill_by_reconstruction

    def score(self, view: LayerView) -> torch.Tensor:
        """Reconstruction scores (measured, or from the call's own queries); sinks ``+inf``, invalid ``-inf``."""
        if self.measured is not None:
            table = self.measured[view.layer_idx].to(view.valid.device)
            inside = view.valid & (view.positions < table.shape[-1])
            scores = torch.where(inside, table.gather(-1, view.positions.clamp(0, table.shape[-1] - 1)), 0.0)
        else:
            scores = self._own_queries(view)
        scores = torch.where(view.positions < self.sinks, torch.inf, scores)
        return torch.where(view.valid, scores, -torch.inf)

    @staticmethod
    def _own_queries(view: LayerView) -> torch.Tensor:
        """The largest attention each token gets from the call's queries other than its own."""
        batch, heads, slots = view.valid.shape
        attention = view.attention.float()  # [batch, query_heads, observed, slots]
        observed = attention.shape[2]
        newest = view.positions.amax(dim=-1, keepdim=True)  # [batch, heads, 1]
        query_positions = newest - observed + 1 + torch.arange(observed, device=newest.device)  # [batch, heads, observed]
        own = query_positions.unsqueeze(-1) == view.positions.unsqueeze(-2)  # [batch, heads, observed, slots]
        if observed == 1:  # a decode step: its one query is all there is
            own = torch.zeros_like(own)
        grouped = attention.view(batch, heads, -1, observed, slots).amax(2)
        return grouped.masked_fill(own, 0.0).amax(2)


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids of KVzip's reconstruction prompt.

    ``first`` / ``later``: the instruction before the first chunk / before each later one (a
    later chunk's prompt also repeats the previous chunk's last ``overlap`` tokens); ``suffix``:
    what follows the instruction (the chat template's end of the user turn and start of the
    assistant's, or ``"\\n"`` without a template); ``prefix``: tokens at the start of the context
    that belong to the template, not the context (not reconstructed, scored 0 beyond the sinks).
    """

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]
    prefix: int = 0
    overlap: int = 8

    @classmethod
    def for_tokenizer(cls, tokenizer: object) -> RepeatPrompt:
        """The prompt kvpress builds for a tokenizer with kvlib's eval interface
        (:class:`~kvlib.eval.models.TextTokenizer`: ``encode(text)``, ``instruct(message)``).

        The chat template's text before and after a user turn is where the ids of two unrelated
        messages put to the model agree (their longest common prefix and suffix), which is what
        kvpress gets by splitting the template's text around a dummy turn (the same ids on
        SmolLM2). Without a chat template the prefix is the BOS token (if any) and the suffix
        ``"\n"``, as kvpress has it.
        """
        one, other = tokenizer.instruct("dummy context\n###"), tokenizer.instruct("Other words!")
        prefix = len(os.path.commonprefix([one, other]))  # element-wise: works on lists of ids
        after = len(os.path.commonprefix([one[::-1], other[::-1]]))
        suffix = tuple(one[len(one) - after :]) if after else tuple(tokenizer.encode("\n"))
        return cls(tuple(tokenizer.encode(FIRST_PROMPT)), tuple(tokenizer.encode(LATER_PROMPT)), suffix, prefix)


def reconstruction_scores(
    model: torch.nn.Module, context_ids: torch.Tensor, prompt: RepeatPrompt, *, sinks: int = 4, chunk: int = 2048
) -> list[torch.Tensor]:
    """Per layer, float32 ``[batch, kv_heads, tokens]``: KVzip's score of each context token.

    Prefills ``context_ids`` (int ``[batch, tokens]``, no padding) into a plain ``DynamicCache``
    with the model's own attention, then, with eager attention (the passes need its weights; it
    is switched on for them only, as it costs 4x a 4k prefill's time on a CPU, and restored), for
    each chunk of ``chunk`` tokens after ``prompt.prefix`` runs the reconstruction prompt over it
    and drops those tokens from the cache again. Attention weights are read by a forward hook on
    each attention module for the duration of the passes and renormalised over the subsampled
    keys (the first ``min(sinks, prefix)`` tokens, the chunk, the prompt), as kvpress computes
    them. Tokens before ``prompt.prefix`` score 0 (the caller keeps the sinks).
    """
    from transformers import DynamicCache

    from kvlib.transformers_compat import cache_argument

    length = context_ids.shape[-1]
    if context_ids.ndim != 2 or length <= prompt.prefix:
        raise ValueError(
            f"context_ids must be [batch, tokens] with more than prompt.prefix={prompt.prefix} tokens, got {list(context_ids.shape)}"
        )
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]
    batch = context_ids.shape[0]
    scores: list[torch.Tensor | None] = [None] * len(modules)
    window: dict[str, int] = {}

    def record(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        weights = output[1].float()  # [batch, query_heads, q, keys]
        start, end, sink = window["start"], window["end"], window["sink"]
        queries = weights.shape[2]
        keep = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(weights.shape[-1] - queries, weights.shape[-1])])
        sub = weights[..., keep.to(weights.device)]
        sub = sub / sub.sum(-1, keepdim=True).clamp(min=torch.finfo(sub.dtype).tiny)
        kv_heads = scores[module.layer_idx].shape[1]
        best = sub[..., sink : sink + end - start].reshape(batch, kv_heads, -1, end - start).amax(2)
        scores[module.layer_idx][..., start:end] = best.to(scores[module.layer_idx].device)
        return (output[0], None, *output[2:])

    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=context_ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
    kv_heads = cache.layers[0].keys.shape[1]
    for layer in range(len(modules)):
        scores[layer] = torch.zeros(batch, kv_heads, length, dtype=torch.float32, device=context_ids.device)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    hooks = []
    try:
        with torch.no_grad():
            hooks = [m.register_forward_hook(record) for m in modules]
            starts = list(range(prompt.prefix, length, chunk))
            for index, start in enumerate(starts):
                end = min(start + chunk, length)
                if index == 0:
                    instruction = torch.tensor(prompt.first, dtype=torch.int64)
                else:
                    instruction = torch.cat(
                        [torch.tensor(prompt.later, dtype=torch.int64), context_ids[0, max(start - prompt.overlap, 0) : start].cpu()]
                    )
                head = torch.cat([instruction, torch.tensor(prompt.suffix, dtype=torch.int64)]).to(context_ids.device)
                ids = torch.cat([head.expand(batch, -1), context_ids[:, start:end]], dim=1)
                window.update(start=start, end=end, sink=min(sinks, start))
                model(input_ids=ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
                cache.crop(-ids.shape[1])
    finally:
        for hook in hooks:
            hook.remove()
        model.set_attn_implementation(previous)
    return scores


def compress(
    model: torch.nn.Module, cache: object, context_ids: torch.Tensor, prompt: RepeatPrompt, scores: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Fill the empty ``cache`` (made with ``make_cache(model, "kvzip...", budget=...)``) with
    ``context_ids`` compressed by KVzip, and return the context's last logits ``[batch, vocab]``.

    Runs :func:`reconstruction_scores` (the context's prefill and one reconstruction pass per
    chunk, on a separate plain cache), then prefills the context into ``cache``, which keeps its
    budget by those scores. Afterwards the cache evicts nothing more (its evictor is removed):
    questions and answers are added to the compressed context, which is what KVzip's
    query-agnostic cache is for; ``cache.batch_repeat_interleave(n)`` gives ``n`` rows sharing its
    pages for ``n`` questions, and ``cache.crop(-k)`` drops a finished question and answer.
    Costs two context prefills plus the reconstruction passes (kvpress: two to three prefills);
    one prefill when ``scores`` (:func:`reconstruction_scores` of this context, prompt and the
    policy's ``sinks`` and ``chunk``, computed for another budget) are given.
    """
    policy = empty_cache_policy(cache, KVzip, "kvzip")
    if scores is None:
        scores = reconstruction_scores(model, context_ids, prompt, sinks=policy.sinks, chunk=policy.chunk)
    return prefill_measured(model, cache, context_ids, policy, scores)


def prefill_by_reconstruction(model: torch.nn.Module, cache: object, context_ids: torch.Tensor, tokenizer: object, memo: dict) -> None:
    """:func:`compress` ``context_ids`` into ``cache`` with :meth:`RepeatPrompt.for_tokenizer`'s prompt
    (:meth:`KVzip.context_prefill`). The reconstruction scores depend on the context, the prompt,
    ``sinks`` and ``chunk``, not on the budget: they are kept in ``memo`` under those, so the same
    context compressed to another budget costs one prefill."""
    prompt = RepeatPrompt.for_tokenizer(tokenizer)
    policy = empty_cache_policy(cache, KVzip, "kvzip")
    key = ("kvzip.reconstruction_scores", prompt, policy.sinks, policy.chunk)
    scores = memo.get(key)
    if scores is None:
        scores = memo[key] = reconstruction_scores(model, context_ids, prompt, sinks=policy.sinks, chunk=policy.chunk)
    compress(model, cache, context_ids, prompt, scores)
