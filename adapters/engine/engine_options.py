"""What an :class:`~kvlib.adapters.engine.engine.Engine` may be built with, and how its specs split
between the engine and its requests.

Checks: every option of ``Engine(...)`` is checked here before the model is touched (before
:func:`~kvlib.adapters.runtime.attention.attach`) or a page is allocated; each failure is a
``ValueError`` naming the option and what is valid. The Engine serves models whose every layer is
attention over one KV layout, full or over a sliding window (Gemma 3, Mistral); it keeps no prefix
cache for a model with sliding-window layers (:func:`keeps_prefix_cache`), so it refuses a remote
tier (which holds prefix pages) for one.

Specs: a quantization codec applies to every request's pages (:func:`engine_codec`: the pages
are shared between requests, so a codec fitted per prompt or a tiering policy is refused);
eviction and budget policies apply per request, each with a fresh evictor
(:func:`request_evictor`: the engine's default spec, or the request's own).
"""

from __future__ import annotations

import torch

from kvlib.adapters.runtime.evictor import Evictor
from kvlib.adapters.runtime.make_evictor import make_evictor
from kvlib.codec import Codec
from kvlib.errors import quoted
from kvlib.limits import check_page_size
from kvlib.model_shape import KVShape, kv_shape
from kvlib.spec import Spec, parse_spec
from kvlib.transformers_compat import cache_layer_types

PREEMPTION_MODES = ("recompute", "swap")


def check_engine(
    model: torch.nn.Module,
    preemption: str,
    page_size: int,
    page_budget_bytes: int | None,
    prefix_cache_bytes: int | None,
    prefix_cache: bool,
    remote: object,
    shared_prefix: object = True,
) -> None:
    """``ValueError`` for the first of these ``Engine`` options that is not valid (each argument is
    the option of its name; the hand-over role's are checked by
    :func:`~kvlib.adapters.engine.handover_roles.check_role`)."""
    if preemption not in PREEMPTION_MODES:
        raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {quoted(preemption)}")
    if not isinstance(shared_prefix, int) or (not isinstance(shared_prefix, bool) and shared_prefix < 0):
        raise ValueError(
            f"shared_prefix must be True, False or an int >= 0 (the fewest (token, KV head) reads per layer a split must save),"
            f" got {quoted(shared_prefix)}"
        )
    check_page_size(page_size)
    _check_bytes("page_budget_bytes", page_budget_bytes, minimum=1)
    _check_bytes("prefix_cache_bytes", prefix_cache_bytes, minimum=0)
    shape = _check_model(model)
    if remote is not None and not prefix_cache:
        raise ValueError("remote needs prefix_cache=True: the remote tier holds the prefix cache's pages")
    if remote is not None and not keeps_prefix_cache(shape):
        raise ValueError(
            f"remote holds prefix-cache pages, and the engine keeps no prefix cache for {type(model).__name__}, whose layers"
            f" slide over windows of {sorted({w for w in shape.windows if w is not None})} tokens: leave remote unset"
        )


def check_speculation(model: torch.nn.Module, codec: Codec | None, eviction: str | None) -> None:
    """``ValueError`` where speculative decoding cannot roll rejected draft tokens back without a
    trace: an eviction spec (its per-slot scores would keep what the rejected tokens added, and
    its compactions reorder slots), a codec (a page the draft filled is sealed after its layer's
    attention, before the rollback) or sliding-window layers (a verification frees positions that
    leave the window of its last draft token, which a rollback needs back)."""
    windows = sorted({w for w in kv_shape(model).windows if w is not None})
    if eviction is not None or codec is not None or windows:
        found = (
            f"the eviction spec {eviction!r}"
            if eviction is not None
            else f"the codec {codec.spec()!r}"
            if codec is not None
            else f"sliding windows of {windows} tokens"
        )
        raise ValueError(
            f"speculate rolls rejected draft tokens back from lossless, full-attention pages; this engine has {found}:"
            " leave speculate unset, or serve without eviction, codec and sliding-window layers"
        )


def keeps_prefix_cache(shape: KVShape) -> bool:
    """Whether the engine indexes full pages for reuse on a model of ``shape``: not where a layer
    slides over a window (its pages stop holding a block's tokens once the window moves on)."""
    return not shape.windows


def engine_codec(spec: Spec) -> Codec | None:
    """The spec's codec (every request's pages): a quantization codec or a low-rank one fixed before
    any prompt (``leank``), or None; ``ValueError`` for codecs the engine cannot share between
    requests (fitted to each prompt) and for tiering."""
    if spec.lowrank is not None and spec.lowrank.fits_each_prompt:
        raise ValueError(
            f"{spec.lowrank.spec()} fits itself to each prompt; the engine's pages are shared by requests: use a quantization codec"
            " or a codec fixed before any prompt (leank)"
        )
    if spec.recompute is not None:
        raise ValueError(
            f"{spec.recompute.spec()} stores checkpoints instead of keys and values; the engine's packed attention reads keys and"
            " values from its pages: use it with kvlib.make_cache(model, spec) and generate"
        )
    if spec.tiering is not None or spec.reuse:
        raise ValueError(f"the engine does not apply tiering or reuse policies yet ({spec}); prefix reuse is built in: prefix_cache=True")
    return spec.quantization or spec.lowrank


def without_codec(spec: Spec) -> str | None:
    """The spec's eviction and budget policies as a spec string (None when it has neither)."""
    kept = [policy.spec() for policy in (spec.eviction, spec.budget) if policy is not None]
    return "+".join(kept) or None


def request_evictor(
    model: torch.nn.Module, spec: str | None, budget: int | float | None, slack: int | None, *, page_size: int
) -> Evictor | None:
    """A fresh evictor for ``spec`` (eviction and budget policies only) on ``model``, or None."""
    if slack is not None and (isinstance(slack, bool) or not isinstance(slack, int) or slack < 0 or not isinstance(budget, int)):
        raise ValueError(f"slack must be an int >= 0 and goes with an int budget, got slack={quoted(slack)}, budget={quoted(budget)}")
    parsed = parse_spec(spec)
    others = [kind for kind in ("quantization", "lowrank", "reuse", "tiering", "recompute") if getattr(parsed, kind)]
    if others:
        raise ValueError(
            f"the engine applies eviction (and budget) policies per request; {parsed} also has {', '.join(others)}"
            " (a quantization codec applies to every request: Engine(model, spec='kivi(bits=4)'); prefix reuse is"
            " built in: prefix_cache=True)"
        )
    evictor = make_evictor(model, parsed, budget, slack, page_size=page_size)
    if evictor is not None and "hidden_states" in evictor.policy.needs:
        raise ValueError(f"{parsed.eviction.spec()} needs the attention input (hidden_states), which the engine does not record")
    return evictor


def _check_bytes(name: str, value: object, *, minimum: int) -> None:
    """``ValueError`` unless ``value`` is None or an int >= ``minimum`` (bytes)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum} (bytes) or None, got {quoted(value)}")


def _check_model(model: torch.nn.Module) -> KVShape:
    """``model``'s KV shape; ``ValueError`` for models kvlib cannot cache (:func:`kv_shape`: MLA, no
    attention KV, ...) or the packed batch cannot serve exactly (recurrent-state layers, layers of
    different KV layouts, attention other than full or over a sliding window: Llama 4's chunked
    layers); before ``attach``."""
    shape = kv_shape(model)
    name = type(model).__name__
    if shape.dense:
        raise ValueError(
            f"the engine attends over packed pages of keys and values; {name} {shape.dense_reason}: use"
            " kvlib.make_cache(model) with model.generate (served densely)"
        )
    if shape.layer_types:
        raise ValueError(
            f"the engine serves models whose every layer is attention; {name} has {', '.join(sorted(set(shape.layer_types)))}"
            " layers (recurrent-state or cache-less layers): use kvlib.make_cache(model) with model.generate"
        )
    if not shape.uniform:
        raise ValueError(
            f"the engine serves models whose layers share one KV layout; {name}'s layers differ (KV heads"
            f" {list(shape.layer_kv_heads)}, head sizes {list(shape.layer_head_dims)}): use kvlib.make_cache(model) with model.generate"
        )
    kinds, _ = cache_layer_types(model.config.get_text_config(decoder=True))
    others = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if others:
        raise ValueError(
            f"the engine serves full-attention and sliding-window layers; {name} has {', '.join(others)} layers:"
            " use kvlib.make_cache(model) with model.generate"
        )
    return shape
