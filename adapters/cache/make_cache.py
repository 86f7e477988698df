"""``make_cache``: the entry point that turns a model and a spec into a ``KVCache``."""

from __future__ import annotations

import torch

from kvlib.adapters.cache.model_hooks import attach
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.adapters.runtime.make_evictor import check_budget, make_evictor, salience_scorer
from kvlib.codec import Codec, layer_shapes
from kvlib.devices import check_fits
from kvlib.limits import MAX_PAGE_SIZE, check_page_size, check_request_tokens
from kvlib.model_shape import KV_LAYER_TYPES, STATE_LAYER_TYPES, KVShape, kv_shape, model_context, shares_kv_across_layers
from kvlib.policy import CheckpointProjection, Tiering
from kvlib.spec import Spec, SpecLike, parse_spec
from kvlib.storage.pools.page_pool import DEFAULT_PAGES_PER_LAYER
from kvlib.storage.prefix.prefix_store import PrefixStore
from kvlib.storage.store.store_config import initial_arena_bytes

CACHE_OPTIONS = {
    "page_size": f"tokens per page (int in [1, {MAX_PAGE_SIZE}], default 16)",
    "read_cache": "keep a dense read mirror per layer (bool; default: only for an exact cache where attention cannot"
    " read pages in place, i.e. CUDA for now)",
    "slack": "extra tokens a head may hold over an int budget while decoding before it is compacted back (int >= 0; default page_size,"
    " 0 for a policy kept as a ring; slack=0 holds a scoring policy's cap to the token, compacting at every step)",
    "interval": "with an int budget, decode steps compact only every this many steps (int >= 1, default 1)",
    "merge": "fold each evicted value into the most similar kept token instead of dropping it (bool, default False)",
    "compileable": "report is_compileable, so that generate compiles its decode steps itself (bool, default False: see"
    " docs/cache.md, torch.compile)",
}
"""Keyword options of :func:`make_cache` and what each one takes."""

_NOT_YET_APPLIED = ("reuse",)


def make_cache(
    model: torch.nn.Module,
    spec: SpecLike | None = None,
    *,
    budget: int | float | None = None,
    reuse: PrefixStore | None = None,
    prompt: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **options: object,
) -> KVCache:
    """A ``transformers`` cache for ``model`` backed by kvlib's paged store.

    With no spec the cache is exact: ``generate`` gives what it gives with ``DynamicCache``. With
    an eviction policy, ``budget`` is how much each (layer, KV head) keeps on average: a token
    count (``int >= 1``, held at all times) or a fraction of the prompt (``float`` in (0, 1],
    applied to the prompt, chunk by chunk under ``generate(..., prefill_chunk_size=N)``). A budget
    policy in the spec (``"snapkv+adaptive"``) splits it over layers and heads; without one the
    eviction policy's own default applies (``pyramidkv``: pyramid), else uniform.

    A quantization or low-rank policy in the spec (``"snapkv+kivi(bits=2)"``, ``"svd"``) encodes
    every sealed page (full pages, after the layer's attention); the open page of each head stays
    in the compute dtype. With a codec the read mirror is off by default (a dense mirror would
    hold every token uncompressed): each read decodes the layer's pages. A tiering policy in the
    spec (``"lru(device_mb=512)"``) keeps at most that many MiB of pages on the device and the rest
    in host memory; the read mirror is off by default with it too (it would hold every page on the
    device).

    An int budget is held while decoding at the cost of a page's bookkeeping a page of steps, not
    a compaction a step: a policy that always drops a head's oldest token past its first few
    (``streaming_llm``) keeps the cap as a ring of slots (each new token takes the oldest one's
    slot before the step; a head never holds more than its cap), and every other policy gets
    ``slack=page_size`` (a head is compacted back to its budget once it holds a page more, so a
    head holds up to ``page_size`` tokens over it: ``memory_report()["slack_tokens"]``). Pass
    ``slack=0`` to hold a scoring policy's cap to the token (a compaction every step).

    Everything is checked before the model runs: the model must be a decoder with attention KV,
    the spec valid (``ValueError`` lists what is registered), the budget in range (numpy and
    torch scalars count as ints and floats; at most :data:`~kvlib.limits.MAX_BUDGET_TOKENS`
    tokens; none without an eviction policy), the options known and the first page arenas
    within the memory the model's device has available. The model's attention is routed through
    kvlib (:func:`kvlib.attach`).

    With ``reuse=kvlib.PrefixStore(model, capacity_bytes=...)`` the cache lives in that store's
    pages: given ``prompt`` (the ids ``generate`` will get; ``attention_mask`` if padded), it
    starts holding the longest cached prefix of it, so ``generate`` computes only the rest, and it
    indexes the prompt's pages for later calls (see :mod:`kvlib.storage.prefix.prefix_store`). Reuse needs every
    prompt token stored as computed: no eviction policy, and no codec that learns from the
    prompt (quantization codecs are fine; their pages are keyed by the spec); a prompt longer than
    the model's context (``max_position_embeddings``) is refused before any lookup.

    Example: ``model.generate(ids, cache=kvlib.make_cache(model, "streaming_llm", budget=64))``
    (``past_key_values=`` on transformers before 5.24).
    """
    shape = kv_shape(model)
    parsed = parse_spec(spec)
    unsupported = [kind for kind in _NOT_YET_APPLIED if getattr(parsed, kind)]
    if unsupported:
        raise ValueError(
            f"make_cache applies eviction, budget, quantization, low-rank and tiering policies; this spec also has"
            f" {', '.join(unsupported)} ({parsed}). Reuse works through make_cache(reuse=kvlib.PrefixStore(...)) and"
            " kvlib.blend_cache(model, chunks, kvlib.ChunkStore(...), policy)"
        )
    dense = shape.dense
    if dense:
        _check_dense(model, shape, parsed, reuse)
    projections = _recompute_projections(model, parsed, reuse)
    budget = check_budget(budget, parsed)
    codec = _codec(parsed)
    page_size, read_cache, slack, interval, merge, compileable = _options(options)
    parameter = next(model.parameters(), None)
    home = (parameter.dtype, parameter.device) if parameter is not None else (torch.float32, torch.device("cpu"))
    shapes = layer_shapes(shape.num_layers, shape.layer_kv_heads, shape.layer_head_dims, shape.layer_value_dims, page_size, *home)
    if codec is not None:
        codec.check_shape(shapes)
    if (slack or interval != 1) and not isinstance(budget, int):
        raise ValueError(f"slack and interval apply to an int budget (a token count), not to budget={budget!r}")
    evictor = make_evictor(model, parsed, budget, slack, interval, merge, page_size=page_size)
    if evictor is None and merge:
        raise ValueError("merge=True folds evicted tokens into kept ones; it needs an eviction policy in the spec")
    if evictor is None:
        evictor = salience_scorer(model, parsed)
    _check_first_arenas(shape, page_size, home, coded=codec is not None, tiered=parsed.tiering is not None)
    _check_reuse(model, shape, parsed, codec, reuse, prompt)
    if parsed.tiering is not None and codec is not None:
        _check_tiered_codec(parsed.tiering, codec, shapes)
    _check_page_retrieval(parsed, reuse)
    needs_hidden = evictor is not None and "hidden_states" in evictor.policy.needs
    attach(model, hidden_states=needs_hidden, route=not dense, checkpoints=projections is not None)
    cache = KVCache(
        shape,
        evictor,
        page_size=page_size,
        read_cache=read_cache,
        codec=codec,
        reuse=reuse,
        spec="" if not parsed.policies() else str(parsed),
        home=home,
        tiering=parsed.tiering,
        compileable=compileable,
        dense=dense,
        projections=projections,
    )
    if shares_kv_across_layers(model):  # the sharing layers attend over what their source layer's update returns
        cache.serve_densely("shares one layer's keys and values with other layers", True, shapes_kept=True)
    if prompt is not None:
        cache.prime(prompt, attention_mask)
    return cache


def _recompute_projections(model: torch.nn.Module, spec: Spec, reuse: PrefixStore | None) -> list[CheckpointProjection] | None:
    """The spec's recompute policy bound to ``model`` (its projections, one per KV layer), or None;
    ``ValueError`` for another policy beside it or prefix reuse (what is stored is checkpoints, not
    keys and values), and for a model the policy does not serve."""
    if spec.recompute is None:
        return None
    others = [policy.spec() for policy in spec.policies() if policy is not spec.recompute]
    if others or reuse is not None:
        what = ", ".join(others) if others else "prefix reuse"
        raise ValueError(
            f"{spec.recompute.spec()} stores checkpoints and recomputes exact keys and values from them; it combines with no other"
            f" policy and no prefix reuse, got {what}"
        )
    return spec.recompute.bind(model)


def _check_reuse(
    model: torch.nn.Module, shape: KVShape, spec: Spec, codec: Codec | None, reuse: PrefixStore | None, prompt: object
) -> None:
    if reuse is None:
        if prompt is not None:
            raise ValueError("prompt= primes a cache from a PrefixStore; pass reuse=kvlib.PrefixStore(model, ...) too")
        return
    if not isinstance(reuse, PrefixStore):
        raise ValueError(f"reuse must be a kvlib.PrefixStore, got {type(reuse).__name__}")
    if shape.has_state_layers:
        raise ValueError(
            f"prefix reuse shares pages cut at page boundaries; {type(model).__name__} has recurrent-state layers"
            f" ({', '.join(sorted(set(shape.layer_types) & STATE_LAYER_TYPES))}) whose state after a prefix is not"
            " stored with the pages, so a cached prefix cannot be resumed: use make_cache(model) without reuse"
        )
    if spec.eviction is not None:
        raise ValueError(
            f"prefix reuse needs every prompt token stored; {spec.eviction.spec()} drops tokens. Use reuse with an exact or quantized"
            " cache, or hold a compressed context whole (kvlib.adapters.compressed_context)"
        )
    if codec is not None and spec.lowrank is not None:
        raise ValueError(f"prefix reuse works with quantization codecs; {spec.lowrank.spec()} fits itself to each prompt")
    if not reuse.identity.matches(model):
        raise ValueError("this PrefixStore was built for another model (config or weights differ)")
    if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1:  # before the prefix store looks anything up
        check_request_tokens(prompt.shape[-1], 0, model_context(model))


def _check_dense(model: torch.nn.Module, shape: KVShape, spec: Spec, reuse: PrefixStore | None) -> None:
    """``ValueError`` for what a model served densely (:mod:`~kvlib.adapters.cache.dense_layer`: its
    attention runs over what the cache returns, outside kvlib) cannot have: any policy or
    prefix reuse (they act after a layer's attention, which kvlib never sees), or hybrid layers."""
    why = shape.dense_reason
    if spec.policies() or reuse is not None:
        what = str(spec) if spec.policies() else "prefix reuse"
        raise ValueError(
            f"{type(model).__name__} {why}, so kvlib serves its cache densely and never sees its attention; {what} acts after"
            " each layer's attention and cannot be applied: use kvlib.make_cache(model) (exact)"
        )
    hybrid = sorted(set(shape.layer_types) & KV_LAYER_TYPES & STATE_LAYER_TYPES)
    if hybrid:
        raise ValueError(f"{type(model).__name__} {why} and has {', '.join(hybrid)} layers; kvlib does not serve that combination")


def _check_page_retrieval(spec: Spec, reuse: PrefixStore | None) -> None:
    """``ValueError`` for what a page-retrieval policy (``quest``) does not combine with yet."""
    if spec.tiering is None or not spec.tiering.retrieves_pages:
        return
    if spec.eviction is not None:
        raise ValueError(
            f"{spec.tiering.spec()} attends over pages chosen per step and evicts nothing; it does not combine with"
            f" eviction ({spec.eviction.spec()}) yet: keep one of them"
        )
    if reuse is not None:
        raise ValueError(f"{spec.tiering.spec()} does not combine with prefix reuse (reuse=PrefixStore) yet")


def _check_tiered_codec(tiering: Tiering, codec: Codec, shapes: list) -> None:
    """``ValueError`` for a codec whose pages cannot move between tiers: a cross-layer codec's
    deeper layers decode with their partner layer's fields, read in place by page id."""
    partnered = [
        layer for layer, layer_codec in enumerate(codec.layer_codecs(shapes)) if getattr(layer_codec, "partner_layer", None) is not None
    ]
    if partnered:
        raise ValueError(
            f"{tiering.spec()} moves sealed pages between tiers; {codec.spec()} is a cross-layer codec (layers {partnered} decode"
            " with an earlier layer's pages, read in place by page id) and does not combine with tiering or quest: use a"
            " quantization codec (kivi, int8, kv_bits, fp8, rotated, gear) or a per-layer low-rank one"
        )


def _codec(spec: Spec) -> Codec | None:
    """The spec's codec policy (quantization or low-rank), or None; ``ValueError`` for both."""
    if spec.quantization is not None and spec.lowrank is not None:
        raise ValueError(
            f"one codec per cache: {spec.quantization.spec()} and {spec.lowrank.spec()} both encode sealed pages; keep one of them"
        )
    return spec.quantization or spec.lowrank


def _check_first_arenas(shape: KVShape, page_size: int, home: tuple[torch.dtype, torch.device], *, coded: bool, tiered: bool) -> None:
    """``ValueError`` when the store the cache builds would preallocate more than the model's
    device has available (its first ``DEFAULT_PAGES_PER_LAYER`` pages a layer), before it is built."""
    dtype, device = home
    layers = shape.num_layers
    nbytes = initial_arena_bytes(
        shape.layer_head_dims,
        shape.layer_value_dims,
        page_size,
        dtype,
        DEFAULT_PAGES_PER_LAYER,
        coded=coded,
        tiered=tiered,
    )
    check_fits(f"make_cache(page_size={page_size}) for {layers} layers", nbytes, device)


def _options(options: dict[str, object]) -> tuple[int, bool | None, int | None, int, bool, bool]:
    unknown = sorted(set(options) - set(CACHE_OPTIONS))
    if unknown:
        valid = "; ".join(f"{name}: {what}" for name, what in CACHE_OPTIONS.items())
        raise ValueError(f"unknown make_cache options {unknown}; valid options are {valid}")
    page_size = check_page_size(options.get("page_size", 16))
    read_cache = options.get("read_cache")
    if read_cache is not None and not isinstance(read_cache, bool):
        raise ValueError(f"read_cache must be a bool, got {read_cache!r}")
    slack = options.get("slack")
    if slack is not None and (isinstance(slack, bool) or not isinstance(slack, int) or slack < 0):
        raise ValueError(f"slack must be an int >= 0, got {slack!r}")
    interval = options.get("interval", 1)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval must be an int >= 1, got {interval!r}")
    merge = options.get("merge", False)
    if not isinstance(merge, bool):
        raise ValueError(f"merge must be a bool, got {merge!r}")
    compileable = options.get("compileable", False)
    if not isinstance(compileable, bool):
        raise ValueError(f"compileable must be a bool, got {compileable!r}")
    return page_size, read_cache, slack, interval, merge, compileable
