"""What a `transformers` model stores per token: its layers' kinds, and per attention layer the
KV heads and head sizes.

:func:`kv_shape` reads it from the model's (text) config, layer by layer (every attribute
transformers makes per-layer is read from that layer's config, ``per_layer_config[i]``), and
from each attention module as built (MiMo-V2-Flash's sliding layers have twice the KV heads of
its full ones, which no config attribute states). Layer kinds follow ``DynamicCache(config=...)``
(:func:`~kvlib.transformers_compat.cache_layer_types`): attention layers hold keys and values
(kvlib's pages), linear-attention, Mamba and convolution layers hold a recurrent or
convolution state, hybrid layers hold both, and ``"dummy"`` layers (MLP-only, MoE-only) hold
nothing.

Multi-head latent attention (MLA: DeepSeek V2/V3, MiniCPM3, Kimi, GLM-4 MoE Lite...) caches, per
token, one compressed latent (``kv_lora_rank`` channels) and one shared rotary key
(``qk_rope_head_dim``), which the model expands into per-head keys and values itself after
``cache.update``: such a layer is one KV "head" whose keys are the latent and whose values are the
rotary key (:attr:`KVShape.latent`).

Refused with a message naming the problem: models without a single attention layer, models that
take no cache or keep one of their own kind (RWKV, xLSTM, Reformer, MiniMax, XLNet), cross-attention
caches (Mllama), encoder-decoder models and layers that keep compressed KV state beside their keys
and values (DeepSeek V4), or whose cache kind kvlib does not know. Layers that keep an indexer's
keys beside theirs (DeepSeek V3.2's sparse attention) are served densely, their indexer keys held
as ``DynamicCache`` holds them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlib.policy import Rope
from kvlib.transformers_compat import cache_layer_types, layer_config

KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "indexed_attention", "hybrid", "hybrid_sliding"})
"""Cache layer types that hold keys and values (kvlib's pages)."""
INDEXED_LAYER_TYPES = frozenset({"indexed_attention"})
"""KV layer types that also keep an indexer's keys (DeepSeek V3.2's sparse attention, DSA): the
model picks the tokens it attends to from them, over the keys and values the cache returns."""
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
"""Cache layer types that hold a recurrent or convolution state (transformers' ``LinearAttentionLayer``)."""
SLIDING_LAYER_TYPES = frozenset({"sliding_attention", "hybrid_sliding"})
"""KV layer types whose attention sees a sliding window of positions."""
NO_CACHE_LAYER_TYPES = frozenset({"dummy"})
"""Cache layer types that hold nothing (transformers' ``DummyLayer``)."""
SHARED_MODULE_LAYER = -1
"""The ``layer_idx`` of an attention module shared by several layers (Zamba2's shared transformer block)."""
_COMPRESSED_LAYER_TYPES = frozenset({"compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse"})
"""Attention layers whose cache keeps compressed KV state beside keys and values."""


@dataclass(frozen=True)
class KVShape:
    """Per-token KV layout of a decoder: its KV layers (the attention layers, numbered ``0 ..
    num_layers - 1`` in model order: the store's, the evictor's and the budgets' layers) and
    its model layers (what ``transformers`` numbers ``layer_idx``).

    Attributes:
        layer_kv_heads: per KV layer, its key/value heads.
        layer_query_heads: per KV layer, its query heads (a multiple of its KV heads).
        layer_head_dims: per KV layer, channels per key head.
        layer_value_dims: per KV layer, channels per value head.
        windows: per KV layer, the sliding window of a sliding-window layer (a query at position
            ``q`` sees positions ``q - window + 1 .. q``), None for a layer that sees every
            position; empty: no layer slides.
        layer_types: per model layer, the cache layer type ``DynamicCache(config=...)`` gives it
            (:data:`KV_LAYER_TYPES` hold keys and values, :data:`STATE_LAYER_TYPES` a recurrent
            state, both for ``"hybrid"``); empty: every model layer is a KV layer.
        state_counts: per model layer, the recurrent/convolution states a state layer keeps
            (transformers' ``number_of_states``), 0 for a layer that keeps none; empty with
            ``layer_types``.
        attention_modules: per KV layer, the ``layer_idx`` its attention module carries, where it
            is not the KV layer's model layer (one module serving every hybrid layer carries -1 in
            Zamba2, Zamba's tied copies None; HRM runs a stack of modules in cycles, cache slot
            ``i`` served by module ``i mod stack``); empty: each KV layer's own (see :attr:`module_layers`).
        own_attention: some KV layer's attention module computes attention itself instead of
            calling transformers' ``AttentionInterface`` (Bloom, Falcon, MPT, GPT-Neo, XGLM, GIT...):
            kvlib's attention function never runs for it, so the cache serves it densely.
        latent: the KV layers cache multi-head latent attention's compressed latent (keys: one
            head of ``kv_lora_rank`` channels; values: the shared rotary key), which the model
            expands into per-head keys and values itself: its attention never runs over what
            the cache returns, so the cache serves it densely (``DynamicCache``'s way).
    """

    layer_kv_heads: tuple[int, ...]
    layer_query_heads: tuple[int, ...]
    layer_head_dims: tuple[int, ...]
    layer_value_dims: tuple[int, ...]
    windows: tuple[int | None, ...] = ()
    layer_types: tuple[str, ...] = ()
    state_counts: tuple[int, ...] = ()
    attention_modules: tuple[int | None, ...] = ()
    own_attention: bool = False
    latent: bool = False

    def __post_init__(self) -> None:
        layers = len(self.layer_kv_heads)
        sizes = (self.layer_query_heads, self.layer_head_dims, self.layer_value_dims)
        if layers < 1 or any(len(size) != layers for size in sizes) or (self.windows and len(self.windows) != layers):
            raise ValueError(f"a KVShape needs one head count and head size per KV layer, for at least one layer; got {self}")
        if self.layer_types and sum(kind in KV_LAYER_TYPES for kind in self.layer_types) != layers:
            raise ValueError(f"layer_types name {sum(kind in KV_LAYER_TYPES for kind in self.layer_types)} KV layers, not {layers}")
        if len(self.state_counts) != len(self.layer_types):
            raise ValueError("state_counts needs one entry per model layer of layer_types")

    @property
    def num_layers(self) -> int:
        """KV layers (attention layers: each calls ``cache.update`` with its model ``layer_idx``)."""
        return len(self.layer_kv_heads)

    @property
    def num_model_layers(self) -> int:
        """The model's decoder layers (KV layers, state layers and layers with no cache)."""
        return len(self.layer_types) or self.num_layers

    @property
    def model_layers(self) -> tuple[int, ...]:
        """Per KV layer, the model layer it is (its attention module's ``layer_idx``)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in KV_LAYER_TYPES)

    @property
    def module_layers(self) -> tuple[int | None, ...]:
        """Per KV layer, the ``layer_idx`` its attention module carries (see :attr:`attention_modules`)."""
        return self.attention_modules or self.model_layers

    @property
    def indexed(self) -> bool:
        """Whether some KV layer keeps an indexer's keys (:data:`INDEXED_LAYER_TYPES`)."""
        return any(kind in INDEXED_LAYER_TYPES for kind in self.layer_types)

    @property
    def dense(self) -> bool:
        """Whether the model attends over what ``cache.update`` returns, outside kvlib (its
        attention is its own, it expands a latent, or an indexer picks the tokens it attends to):
        its cache is served densely (:attr:`dense_reason` says why)."""
        return self.own_attention or self.latent or self.indexed

    @property
    def dense_reason(self) -> str:
        """Why the model attends outside kvlib, to follow its name in a message ("" where it does not)."""
        if self.own_attention:
            return "computes attention itself (outside transformers' AttentionInterface)"
        if self.latent:
            return "caches multi-head latent attention's latent, which it expands into keys and values itself"
        if self.indexed:
            return "picks the tokens its attention reads with a sparse-attention indexer of its own"
        return ""

    def kv_layer(self, model_layer: int) -> int | None:
        """The KV layer that ``model_layer`` is, or None for a layer holding no keys and values."""
        layers = self.model_layers
        return layers.index(model_layer) if model_layer in layers else None

    def layer_type(self, model_layer: int) -> str:
        """``model_layer``'s cache layer type (see :attr:`layer_types`)."""
        if self.layer_types:
            return self.layer_types[model_layer]
        return "sliding_attention" if self.window(model_layer) is not None else "full_attention"

    def state_count(self, model_layer: int) -> int:
        """Recurrent/convolution states ``model_layer`` keeps (0: none)."""
        return self.state_counts[model_layer] if self.state_counts else 0

    @property
    def has_state_layers(self) -> bool:
        """Whether some layer keeps a recurrent or convolution state (a hybrid model: Jamba, Zamba2...)."""
        return any(kind in STATE_LAYER_TYPES for kind in self.layer_types)

    @property
    def uniform(self) -> bool:
        """Whether every KV layer has the same KV heads, query heads and head sizes."""
        return all(len(set(sizes)) == 1 for sizes in self._sizes().values())

    @property
    def num_kv_heads(self) -> int:
        """KV heads of every KV layer; ``ValueError`` where layers differ (read :attr:`layer_kv_heads`)."""
        return self._same("layer_kv_heads")

    @property
    def num_query_heads(self) -> int:
        """Query heads of every KV layer; ``ValueError`` where layers differ (read :attr:`layer_query_heads`)."""
        return self._same("layer_query_heads")

    @property
    def head_dim(self) -> int:
        """Key channels of every KV layer; ``ValueError`` where layers differ (read :attr:`layer_head_dims`)."""
        return self._same("layer_head_dims")

    @property
    def value_dim(self) -> int:
        """Value channels of every KV layer; ``ValueError`` where layers differ (read :attr:`layer_value_dims`)."""
        return self._same("layer_value_dims")

    def window(self, layer: int) -> int | None:
        """KV layer ``layer``'s sliding window, or None where it attends to every position."""
        return self.windows[layer] if self.windows else None

    def _sizes(self) -> dict[str, tuple[int, ...]]:
        return {
            "layer_kv_heads": self.layer_kv_heads,
            "layer_query_heads": self.layer_query_heads,
            "layer_head_dims": self.layer_head_dims,
            "layer_value_dims": self.layer_value_dims,
        }

    def _same(self, name: str) -> int:
        values = self._sizes()[name]
        if len(set(values)) != 1:
            raise ValueError(f"the model's layers differ in {name.removeprefix('layer_')} ({list(values)}); this needs one for all layers")
        return values[0]


def kv_shape(model: torch.nn.Module) -> KVShape:
    """The KV layout of ``model``; ``ValueError`` (before any model work) if it has none kvlib can hold."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"kvlib caches `transformers` PreTrainedModel decoders; got {type(model).__name__}, which has no config"
            " or no set_attn_implementation"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; kvlib caches decoder-only models")
    text = config.get_text_config(decoder=True)
    name = f"{type(model).__name__} (model_type {getattr(text, 'model_type', '?')!r})"
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{name} has no attention KV to cache: its config lacks num_hidden_layers")
    _check_cache_kind(model, name, text)
    kinds, kwargs = cache_layer_types(text)
    _check_layer_types(name, kinds)
    model_layers = [i for i, kind in enumerate(kinds) if kind in KV_LAYER_TYPES]
    if not model_layers:
        raise ValueError(
            f"{name} has no attention layer ({', '.join(sorted(set(kinds)))} only): it keeps recurrent state, no keys and"
            " values, and kvlib's pages hold keys and values; use DynamicCache"
        )
    modules = _attention_modules_by_layer(model)
    module_layers = [_module_layer(i, modules, len(kinds)) for i in model_layers]
    own_attention = not type(model)._can_set_attn_implementation() or any(
        not any(_calls_attention_interface(module) for module in modules.get(i, ())) for i in set(module_layers) if i in modules
    )
    modules = {i: found[0] for i, found in modules.items()}
    configs = [layer_config(text, i) for i in model_layers]
    latent = [_latent_sizes(config) for config in configs]
    if any(sizes is None for sizes in latent) and any(sizes is not None for sizes in latent):
        raise ValueError(f"{name} mixes multi-head latent attention layers with others; kvlib serves one or the other")
    sizes = latent if latent[0] is not None else [_layer_sizes(name, config, modules.get(i)) for config, i in zip(configs, module_layers)]
    windows = tuple(_window(kwargs[i]) if kinds[i] in SLIDING_LAYER_TYPES else None for i in model_layers)
    mixed = any(kind not in KV_LAYER_TYPES or kind in STATE_LAYER_TYPES or kind in INDEXED_LAYER_TYPES for kind in kinds)
    return KVShape(
        *(tuple(size[n] for size in sizes) for n in range(4)),
        windows=windows if any(window is not None for window in windows) else (),
        layer_types=tuple(kinds) if mixed else (),
        state_counts=tuple(kwargs[i].get("number_of_states", 1) if kind in STATE_LAYER_TYPES else 0 for i, kind in enumerate(kinds))
        if mixed
        else (),
        attention_modules=tuple(module_layers) if module_layers != model_layers else (),
        own_attention=own_attention,
        latent=latent[0] is not None,
    )


def _module_layer(model_layer: int, modules: dict[int | None, list[torch.nn.Module]], layers: int) -> int | None:
    """The ``layer_idx`` of the attention module serving ``model_layer``: its own; else that of the
    modules shared by the layers without their own (-1: Zamba2's shared transformer block; None:
    Zamba's tied copies); else, where modules ``0 .. n - 1`` run in cycles over ``layers`` cache
    slots (HRM), ``model_layer mod n``."""
    if model_layer in modules:
        return model_layer
    for shared in (SHARED_MODULE_LAYER, None):
        if shared in modules:
            return shared
    stack = len(modules)
    if stack and sorted(modules) == list(range(stack)) and layers % stack == 0:
        return model_layer % stack
    return model_layer


def _calls_attention_interface(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward calls transformers' ``AttentionInterface`` (its source names
    ``ALL_ATTENTION_FUNCTIONS``; a forward whose source cannot be read is taken to)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True
    return "ALL_ATTENTION_FUNCTIONS" in source


def _latent_sizes(config: object) -> tuple[int, int, int, int] | None:
    """``(1, 1, kv_lora_rank, qk_rope_head_dim)`` for a multi-head latent attention layer (what it
    caches per token: one latent "head" as keys, the shared rotary key as values), else None."""
    rank = getattr(config, "kv_lora_rank", None)
    rope = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rank, int) or not isinstance(rope, int):
        return None
    return 1, 1, rank, rope


def _window(layer_kwargs: dict) -> int | None:
    """A sliding layer's window (``DynamicCache``'s ``sliding_window`` for it), None where unset.
    Chunked attention (Llama 4) is not a window: its layers hold every token."""
    window = layer_kwargs.get("sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else None


def _layer_sizes(name: str, config: object, module: torch.nn.Module | None) -> tuple[int, int, int, int]:
    """``(kv_heads, query_heads, head_dim, value_dim)`` of one attention layer, as its attention
    module was built where it says (``num_heads`` / ``num_attention_heads``,
    ``num_key_value_heads`` or ``num_key_value_groups``, ``head_dim`` / ``attention_head_size``,
    ``v_head_dim``: a module without grouped-query attributes but with its head count holds a
    KV head per query head), else from its layer config."""
    heads = _built(module, "num_heads") or _built(module, "num_attention_heads") or getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"{name} has no attention KV to cache: its config lacks num_attention_heads")
    groups = _built(module, "num_key_value_groups")
    kv_heads = _built(module, "num_key_value_heads")
    if kv_heads is None and groups is not None and heads % groups == 0:
        kv_heads = heads // groups
    if kv_heads is None and (_built(module, "num_heads") or _built(module, "num_attention_heads")):
        kv_heads = heads
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or heads
    head_dim = (
        _built(module, "head_dim")
        or _built(module, "attention_head_size")
        or getattr(config, "head_dim", None)
        or config.hidden_size // heads
    )
    value_dim = _built(module, "v_head_dim") or getattr(config, "v_head_dim", None) or head_dim
    if heads % kv_heads:
        raise ValueError(f"{name}: {heads} query heads are not a multiple of {kv_heads} KV heads")
    return kv_heads, heads, head_dim, value_dim


def _built(module: torch.nn.Module | None, attribute: str) -> int | None:
    """A positive int ``attribute`` of an attention module as built, or None."""
    value = getattr(module, attribute, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _check_cache_kind(model: torch.nn.Module, name: str, text: object) -> None:
    """``ValueError`` for a model that takes no ``transformers`` cache, keeps a cache of its own
    kind (RWKV's and xLSTM's states, Reformer's hash buckets, MiniMax's and XLNet's own classes:
    transformers builds them no ``DynamicCache`` either), or caches cross-attention keys and values
    beside its own (Mllama's image states, read back from every layer's ``keys``)."""
    parameters = inspect.signature(type(model).forward).parameters  # the class's: a wrapped or compiled forward hides it
    if "cache" not in parameters and "past_key_values" not in parameters:
        raise ValueError(f"{name} takes no transformers cache (its forward has no cache argument): there is nothing to hold")
    supports_dynamic_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic_cache is not None and not supports_dynamic_cache():
        raise ValueError(
            f"{name} keeps a cache of its own kind, which transformers builds for it instead of a DynamicCache; kvlib's pages"
            " hold attention keys and values only"
        )
    if getattr(text, "cross_attention_layers", None):
        raise ValueError(
            f"{name} has cross-attention layers (to image states), whose cache holds the image's keys and values beside"
            " the text's and is read back from each layer's keys tensor; kvlib's pages hold self-attention keys and values only"
        )


def _check_layer_types(name: str, kinds: Sequence[str]) -> None:
    """``ValueError`` for layers whose cache holds compressed KV, or is of a kind kvlib does not know."""
    compressed = sorted(set(kinds) & _COMPRESSED_LAYER_TYPES)
    if compressed:
        raise ValueError(
            f"{name} has {', '.join(compressed)} layers, whose cache keeps compressed KV state beside keys and values;"
            " kvlib holds per-head keys and values only, so these models are not supported"
        )
    unknown = sorted(set(kinds) - KV_LAYER_TYPES - STATE_LAYER_TYPES - NO_CACHE_LAYER_TYPES)
    if unknown:
        raise ValueError(f"{name} has {', '.join(unknown)} layers, a cache layer kind kvlib does not hold; these models are not supported")


def _attention_modules_by_layer(model: torch.nn.Module) -> dict[int | None, list[torch.nn.Module]]:
    """Each ``layer_idx``'s attention modules (a class name ending with ``Attention`` and a
    ``layer_idx``: an int, or None set on modules shared by layers; an attention block and the
    self-attention inside it), in ``modules()`` order, within the decoder (:func:`_decoder`)."""
    found: dict[int | None, list[torch.nn.Module]] = {}
    for module in _decoder(model).modules():
        if not type(module).__name__.endswith("Attention") or "layer_idx" not in vars(module):
            continue
        layer = module.layer_idx
        if layer is None or (isinstance(layer, int) and not isinstance(layer, bool)):
            found.setdefault(layer, []).append(module)
    return found


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder of ``model`` (``get_decoder``: a multimodal model's language model, whose
    vision and audio towers number their own attention modules' ``layer_idx`` alike), else the model."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def rope_of(model: torch.nn.Module, shape: KVShape) -> Rope | None:
    """The model's rotary embedding (its first module with an ``inv_freq`` buffer), or None
    without RoPE. Partial rotary embeddings (``inv_freq`` covering fewer than the head's
    channels) and layers of several head sizes are reported as None too: :class:`Rope`
    describes one whole-head rotation for every layer only."""
    if len(set(shape.layer_head_dims)) != 1:
        return None
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            if 2 * inv_freq.numel() != shape.layer_head_dims[0]:
                return None
            return Rope(inv_freq.detach().float(), float(getattr(module, "attention_scaling", 1.0)))
    return None


def attention_modules(model: torch.nn.Module, shape: KVShape) -> list[torch.nn.Module]:
    """Each KV layer's attention module, in layer order: the modules with an int ``layer_idx`` (the
    KV layer's model layer) and an output projection (``o_proj``, a ``Linear``: Llama family; or
    GPT-2's ``c_attn`` with a ``c_proj``). ``ValueError`` for a model without one in every KV layer."""
    found: dict[int, torch.nn.Module] = {}
    for module in _decoder(model).modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            continue
        if isinstance(getattr(module, "o_proj", None), torch.nn.Linear) or (
            hasattr(module, "c_attn") and isinstance(getattr(getattr(module, "c_proj", None), "weight", None), torch.Tensor)
        ):
            found[layer] = module
    missing = [layer for layer in shape.model_layers if layer not in found]
    if missing:
        raise ValueError(
            f"{type(model).__name__}: no attention module with an output projection (o_proj or GPT-2's c_proj) found in"
            f" layers {missing} (found layers {sorted(found)})"
        )
    return [found[layer] for layer in shape.model_layers]


def output_projections(model: torch.nn.Module, shape: KVShape) -> list[torch.Tensor]:
    """Each KV layer's attention output projection split by query head: ``[query_heads,
    value_dim, hidden]`` per layer (views of the weights, no copies), so that the attention
    module's output is ``sum_h out_h @ W_o[h]`` plus its bias.

    The modules are :func:`attention_modules`'; ``o_proj`` is a ``Linear`` (``weight`` is
    ``[hidden, heads * value_dim]``), GPT-2's ``c_proj`` a ``Conv1D`` (``weight`` is ``[heads *
    value_dim, hidden]``). ``ValueError`` (naming output_projection) for a model without them."""
    try:
        modules = attention_modules(model, shape)
    except ValueError as exc:
        raise ValueError(f"{exc}; policies that need output_projection cannot run on it") from None
    weights = [m.o_proj.weight.detach().t() if hasattr(m, "o_proj") else m.c_proj.weight.detach() for m in modules]
    return [w.reshape(heads, value_dim, -1) for w, heads, value_dim in zip(weights, shape.layer_query_heads, shape.layer_value_dims)]


def model_context(model: torch.nn.Module) -> int | None:
    """The most positions ``model``'s (text) config declares it takes (``max_position_embeddings``,
    ``n_positions`` for GPT-2), or None where it declares none."""
    text = model.config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def shares_kv_across_layers(model: torch.nn.Module) -> bool:
    """Whether some layers of ``model`` attend over keys and values another layer computed and
    stored, calling no cache ``update`` of their own (Gemma 3n and Gemma 4's KV sharing: the
    config's ``kv_sharing_modes`` has ``"reuse"`` layers)."""
    text = model.config.get_text_config(decoder=True)
    modes = getattr(text, "kv_sharing_modes", None) or ()
    return "reuse" in modes


def kv_heads_text(layer_kv_heads: Sequence[int]) -> str:
    """A model's KV heads per layer for a message: ``"5 x 4"`` (layers x KV heads) when every layer
    has the same, else ``"5 layers of [4, 8, 4, 8, 4] KV heads"``."""
    heads = list(layer_kv_heads)
    if len(set(heads)) == 1:
        return f"{len(heads)} x {heads[0]}"
    return f"{len(heads)} layers of {heads} KV heads"
