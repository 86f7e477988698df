"""A codec's work on one cache layer after its attention: fitting and sealing.

A codec that learns from the prompt (``svd``, ``think``...) observes the layer's first call
(:func:`layers_to_seal`): its stored tokens and queries, padding marked invalid
(:func:`fit_sample`). Then the layer's full pages are sealed (encoded, :func:`seal`), and once a
cross-layer fit becomes ready every layer up to this one too; a codec that reads token salience
gets the compressor's scores of the layer's tokens, computed only if a page seals.
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.shared_state import SharedState
from kvlib.adapters.runtime.after_attention import Salience
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.codec import FitSample


def layers_to_seal(cache: SharedState, layer_idx: int, step: LayerStep, query: torch.Tensor, real_new: torch.Tensor | None) -> list[int]:
    """Let the codec of ``layer_idx``, if it learns and is not ready, observe this call (``step``,
    ``query``; ``real_new``: the call's real tokens, None: all); returns the layers whose full
    pages seal now: this one, or every layer up to it once a cross-layer fit became ready."""
    codec = cache.codecs[layer_idx] if cache.codecs is not None else None
    if codec is not None and codec.learns and not codec.ready:
        codec.observe(fit_sample(cache, layer_idx, step, query, real_new))
        if codec.ready:  # a cross-layer fit readies earlier layers too
            return list(range(layer_idx + 1))
    return [layer_idx]


def seal(cache: SharedState, layer_idx: int, sealing: list[int], salience: Salience | None = None) -> None:
    """Seal the full pages of the ``sealing`` layers (a cache without codecs seals nothing), the
    codec of ``layer_idx`` given ``salience`` if it reads it."""
    if cache.codecs is None:
        return
    codec = cache.codecs[layer_idx]
    for layer in sealing:
        cache.store.seal(layer, cache.rows, salience if layer == layer_idx and codec is not None and codec.uses_salience else None)


def fit_sample(cache: SharedState, layer_idx: int, step: LayerStep, query: torch.Tensor, real_new: torch.Tensor | None) -> FitSample:
    """The layer's stored tokens (``step.read``) and this call's queries, padding marked invalid."""
    read = step.read
    real = read.valid & (read.positions >= cache.padding.view(-1, 1, 1))
    query_valid = real_new if real_new is not None else torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
    return FitSample(layer_idx, read.keys, read.values, real, query, query_valid)
