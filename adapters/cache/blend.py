"""``blend_cache``: a prompt's cache assembled from chunks computed on their own (CacheBlend).

1. Each chunk's keys and values come from a :class:`~kvlib.ChunkStore` (computed alone at
   positions ``0 ..``); keys are re-rotated to the chunk's place in the prompt
   (:func:`kvlib.rope.rerotate`, exact) and everything is concatenated: the *fused* cache.
2. With the ``deviation`` rule, a probe runs the model on every token with full attention up to
   ``probe_layer`` (a pre-hook on the next attention layer stops it); those layers take the
   probe's KV, and each token's squared KV deviation at ``probe_layer`` ranks it.
3. The chosen tokens (``recompute`` of them) go through the model once more, alone, at their
   true positions; at every layer they overwrite their own KV and attend over the fused cache
   (:meth:`KVCache.recomputing`). The rest keeps its chunk-local KV.

The result is an exact ``KVCache`` holding the chunks; ``generate(chunks + question, cache=cache)``
computes only the question. Compute: the probe's layers on every token plus the chosen tokens on
every layer, instead of a prefill of every token on every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib.adapters.cache.chunk_store import ChunkStore
from kvlib.adapters.cache.make_cache import make_cache
from kvlib.adapters.cache.transformers_cache import KVCache
from kvlib.model_shape import kv_shape, rope_of
from kvlib.policies.reuse.cacheblend import CacheBlend
from kvlib.rope import rerotate
from kvlib.transformers_compat import cache_argument


class _StopForward(Exception):
    """Raised by the probe's hook once the layers it needs have run."""


def blend_cache(model: torch.nn.Module, chunks: Sequence[torch.Tensor], store: ChunkStore, policy: CacheBlend | None = None) -> KVCache:
    """An exact cache holding ``chunks`` (each int ``[tokens]``) concatenated, built by ``policy``
    (default ``CacheBlend()``: 15% of the tokens recomputed, chosen by KV deviation)."""
    policy = policy or CacheBlend()
    shape = kv_shape(model)
    if shape.has_state_layers:
        raise ValueError(
            f"chunk reuse joins chunks computed alone; {type(model).__name__} has recurrent-state layers, whose state after a"
            " chunk depends on every token before it, so chunks cannot be computed alone: use make_cache(model)"
        )
    rope = rope_of(model, shape)
    if rope is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding kvlib can re-rotate: chunk reuse needs RoPE")
    if not chunks:
        raise ValueError("blend_cache needs at least one chunk")
    if policy.probe_layer >= shape.num_layers:
        raise ValueError(f"probe_layer {policy.probe_layer} must be below the model's {shape.num_layers} layers")
    pieces = [store.kv(model, chunk) for chunk in chunks]
    lengths = [keys[0].shape[1] for keys, _ in pieces]
    offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    keys = [
        torch.cat([rerotate(k[layer], offset, rope) for (k, _), offset in zip(pieces, offsets)], dim=1)[None]
        for layer in range(shape.num_layers)
    ]
    values = [torch.cat([v[layer] for _, v in pieces], dim=1)[None] for layer in range(shape.num_layers)]
    ids = torch.cat([torch.as_tensor(chunk).reshape(-1) for chunk in chunks])[None].to(keys[0].device)
    deviation = None
    if policy.select == "deviation" and policy.count(ids.shape[1]):
        deviation = _probe(model, ids, keys, values, policy.probe_layer)
    chosen = policy.choose(lengths, deviation)
    cache = make_cache(model)
    cache.load(keys, values)
    if chosen.numel():
        positions = chosen.to(ids.device)
        with torch.no_grad(), cache.recomputing(chosen):
            model(input_ids=ids[:, positions], position_ids=positions[None], **cache_argument(cache), use_cache=True, logits_to_keep=1)
    return cache


def _probe(model: torch.nn.Module, ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], layer: int) -> torch.Tensor:
    """Run layers ``0..layer`` on every token with full attention; put their KV into ``keys`` and
    ``values`` (in place) and return each token's squared KV deviation at ``layer`` from the fused one."""
    probe = make_cache(model)
    stop = [m for m in model.modules() if getattr(m, "layer_idx", None) == layer + 1 and type(m).__name__.endswith("Attention")]
    hooks = [m.register_forward_pre_hook(_stop) for m in stop]
    try:
        with torch.no_grad():
            model(input_ids=ids, **cache_argument(probe), use_cache=True, logits_to_keep=1)
    except _StopForward:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    deviation = None
    for index in range(layer + 1):
        read = probe.store.read(index, probe._rows)
        if index == layer:
            deviation = (
                (read.keys - keys[index]).float().square().sum((1, 3)) + (read.values - values[index]).float().square().sum((1, 3))
            )[0]
        keys[index], values[index] = read.keys.clone(), read.values.clone()
    return deviation


def _stop(module: torch.nn.Module, args: tuple) -> None:
    raise _StopForward
