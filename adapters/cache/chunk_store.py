"""``ChunkStore``: the KV of text chunks computed on their own, for position-independent reuse.

A chunk (a RAG passage, a document) is run through the model alone, at positions ``0 ..
len - 1``, once; its keys (after RoPE) and values per layer are kept, keyed by the model's
fingerprint (:mod:`kvlib.model_identity`: class, config and every weight; a model without it is
refused) and the chunk's token ids. :func:`kvlib.blend_cache` assembles prompts from them in
any order. Entries are evicted least recently used first beyond ``capacity_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvlib.adapters.cache.make_cache import make_cache
from kvlib.devices import outside_inference_mode
from kvlib.model_identity import ModelIdentity
from kvlib.transformers_compat import cache_argument


class ChunkStore:
    """Per-chunk keys and values ``[kv_heads, tokens, dim]`` per layer, for one model."""

    def __init__(self, model: torch.nn.Module, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.identity = ModelIdentity(model)
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    @outside_inference_mode
    def kv(self, model: torch.nn.Module, chunk: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of ``chunk`` (int ``[tokens]``) computed alone, per layer."""
        if not self.identity.matches(model):
            raise ValueError("this ChunkStore was built for another model (config or weights differ)")
        key = tuple(torch.as_tensor(chunk).reshape(-1).tolist())
        if not key:
            raise ValueError("a chunk needs at least one token")
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        cache = make_cache(model)
        ids = torch.tensor([key], device=next(model.parameters()).device)
        with torch.no_grad():
            model(input_ids=ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        reads = [cache.store.read(layer, cache._rows) for layer in range(cache.shape.num_layers)]
        keys = [read.keys[0].clone() for read in reads]
        values = [read.values[0].clone() for read in reads]
        self.entries[key] = (keys, values)
        self.nbytes += sum(t.numel() * t.element_size() for t in keys + values)
        while self.nbytes > self.capacity_bytes and len(self.entries) > 1:
            _, (old_keys, old_values) = self.entries.popitem(last=False)
            self.nbytes -= sum(t.numel() * t.element_size() for t in old_keys + old_values)
        return keys, values
