"""Greedy generation for many cache configurations from one prompt call (a shared prefill).

:func:`generate_shared` runs ``model.generate`` over a batch of prompts once, through an exact
source cache that records what the configurations' after-attention work needs
(:mod:`kvlib.adapters.cache.shared_prefill`). Then, for each configuration in turn, it builds the
configuration's cache, replays the prompt call into it and continues greedy generation from the
first token the shared prompt call chose. Each configuration's tokens and cache equal those of
``model.generate(ids, attention_mask=mask, cache=make(width), do_sample=False, ...)`` run alone:
its prompt call would have computed the same logits (attention runs before any eviction), its
cache holds what that call would have left, and the continuation is ``generate`` itself, given
the prompt and the first token, with rows that ended on their first token padded from then on as
``generate`` pads finished rows.

:func:`shares` says whether a configuration may take this path; the caller runs the others apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import kvlib
from kvlib.adapters.cache.shared_prefill import PrefillNeeds, PrefillRecorder, prefill_needs, recording, replay, sharing_refusal
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.eval.task import CacheFactory
from kvlib.transformers_compat import cache_argument

PROBE_TOKENS = 1024
"""The sequence length :func:`shares` builds its probe cache for (any length the factory takes)."""


@dataclass(frozen=True)
class Sharing:
    """Whether a configuration takes the shared prefill (``refusal`` None) and what it needs recorded."""

    needs: PrefillNeeds
    refusal: str | None = None


def shares(model: torch.nn.Module, make_cache: CacheFactory) -> Sharing:
    """Whether caches from ``make_cache`` can take a shared prefill on ``model`` (a probe cache is
    built and dropped): not when the model prefills in chunks (``prefill_chunk_size``), nor for a
    cache that is not a kvlib cache or that :func:`sharing_refusal` refuses."""
    if getattr(model.generation_config, "prefill_chunk_size", None):
        return Sharing(PrefillNeeds(), "the model prefills in chunks (generation_config.prefill_chunk_size)")
    probe = make_cache(PROBE_TOKENS)
    if not isinstance(probe, KVCache):
        return Sharing(PrefillNeeds(), f"{type(probe).__name__} is not a kvlib cache")
    needs = prefill_needs(probe)
    if needs.attention and "eager" in str(model.config._attn_implementation):
        return Sharing(needs, "eager attention returns weights that a replay cannot recompute")
    return Sharing(needs, sharing_refusal(probe))


@dataclass
class Generation:
    """One configuration's generated tokens (int64 ``[batch, new]``, as ``generate`` returns them
    after the prompt) and its cache at the end; or the one-line ``error`` it raised."""

    tokens: torch.Tensor | None = None
    cache: KVCache | None = None
    error: str | None = None


def generate_shared(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    factories: Sequence[CacheFactory],
    needs: PrefillNeeds,
    *,
    max_new_tokens: int,
    pad: int,
) -> Iterator[Generation]:
    """Each configuration's greedy generation from ``ids`` (int64 ``[batch, width]``, left-padded
    per ``mask``), in the order of ``factories`` (each called with ``width``), one at a time (a
    configuration's cache is dropped once the caller moves on); the prompt runs once. ``needs``:
    the union of the configurations' (:func:`shares`). A configuration that raises gives its error
    and the others go on; the prompt call itself raising is raised."""
    width = ids.shape[1]
    source = kvlib.make_cache(model)
    recorder = PrefillRecorder(needs)
    with recording(source, recorder), torch.inference_mode():
        first = model.generate(ids, attention_mask=mask, **cache_argument(source), max_new_tokens=1, do_sample=False, pad_token_id=pad)[
            :, width:
        ]
    for make in factories:
        try:
            cache = make(width)
            with torch.inference_mode():
                replay(cache, source, recorder)
                tokens = continue_generation(model, ids, mask, first, cache, max_new_tokens, pad)
            yield Generation(tokens, cache)
        except Exception as exc:  # noqa: BLE001 - a failing configuration is reported, the rest still run
            yield Generation(error=f"{type(exc).__name__}: {exc}".splitlines()[0])


def continue_generation(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, cache: KVCache, max_new_tokens: int, pad: int
) -> torch.Tensor:
    """The tokens ``generate(ids, attention_mask=mask, cache=..., max_new_tokens=max_new_tokens)``
    gives after the prompt, for a ``cache`` that holds what the prompt call left and ``first``
    (int64 ``[batch, 1]``), the token that call chose."""
    ended = _ends(model, first[:, 0])
    if max_new_tokens <= 1 or bool(ended.all()):
        return first
    extra = {}
    if bool(ended.any()):  # generate would pad these rows from the next token on
        extra = {
            "logits_processor": LogitsProcessorList([_PadRows(ended, pad)]),
            "stopping_criteria": StoppingCriteriaList([_RowsEnded(ended)]),
        }
    out = model.generate(
        torch.cat([ids, first], dim=1),
        attention_mask=torch.cat([mask, torch.ones_like(first, dtype=mask.dtype)], dim=1),
        **cache_argument(cache),
        max_new_tokens=max_new_tokens - 1,
        do_sample=False,
        pad_token_id=pad,
        **extra,
    )
    return out[:, ids.shape[1] :]


def _ends(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Bool ``[batch]``: which ``tokens`` end generation (the generation config's EOS ids)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return torch.zeros_like(tokens, dtype=torch.bool)
    eos = torch.as_tensor(eos if isinstance(eos, list) else [eos], device=tokens.device)
    return torch.isin(tokens, eos)


class _PadRows(LogitsProcessor):
    """Makes the pad token the only choice of the ``rows`` (bool ``[batch]``)."""

    def __init__(self, rows: torch.Tensor, pad: int) -> None:
        self.rows, self.pad = rows, pad

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -torch.inf)
        forced[:, self.pad] = 0.0
        return torch.where(self.rows.to(scores.device).view(-1, 1), forced, scores)


class _RowsEnded(StoppingCriteria):
    """Marks the ``rows`` (bool ``[batch]``) finished."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.rows.to(input_ids.device).clone()
