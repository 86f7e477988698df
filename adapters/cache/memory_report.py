"""``memory_report``: the bytes a :class:`~kvlib.adapters.KVCache` holds, by tier and component."""

from __future__ import annotations

import torch

from kvlib.adapters.runtime.evictor import Evictor
from kvlib.model_shape import KVShape
from kvlib.storage.store.paged_store import PagedStore

STORE_COMPONENTS = ("pages", "positions", "codec_metadata", "key_summaries", "tables", "read_cache")
"""What the paged store's bytes split into."""
COMPONENTS = (*STORE_COMPONENTS, "unpaged_state")
"""What ``by_component`` splits the bytes held into."""


def memory_report(store: PagedStore | None, rows: list[int], shape: KVShape, evictor: Evictor | None = None, state_bytes: int = 0) -> dict:
    """Bytes a cache whose ``rows`` (store sequences) live in ``store`` holds, and what a full
    cache in the compute dtype would hold. A cache holding no rows (before its first update, after
    ``reset``) holds no pages: only its store's reserved arenas and peaks are reported then (all
    zeros before any store exists), and the recurrent states a hybrid model's layers keep
    allocated (zeroed by ``reset``, as transformers keeps them).

    Keys: ``total_bytes``; ``by_tier`` (``device``: the store's device, ``host``, ``disk``);
    ``by_component`` (``pages``: keys and values of pages in use, ``positions``,
    ``codec_metadata``, ``key_summaries``: page retrieval's per-page key minima and maxima (on
    the device), ``tables``: block tables and lengths, ``read_cache``: the dense read
    mirror, ``unpaged_state``: ``state_bytes``, what layers hold outside the pages as
    ``DynamicCache`` holds it: a hybrid model's recurrent and convolution states, a sparse-attention
    indexer's keys); ``reserved_bytes``: whole arenas, free pages included; ``peak_pages_bytes``: the
    most ``pages`` bytes held at any moment since the store was created (between a layer's
    append and its compaction included: the peak of a prefill); ``peak_workspace_bytes``: the
    largest transient dense copy of a layer a call attended over (prefill, chunks; not held
    after the call, so not in ``total_bytes``); ``full_equivalent_bytes``:
    keys and values, uncompressed, of what a full cache keeps (``DynamicCache``): every logical
    token of a layer, its last ``window - 1`` in a sliding-window layer, and ``state_bytes``; ``stored_tokens`` and
    ``logical_tokens``, summed over layers, rows and KV heads; ``slack_tokens``: the stored tokens
    over ``evictor``'s held cap (an int budget) that its ``slack`` holds now, summed likewise
    (0 without an evictor, and for a ring, which never holds more than the cap).
    """
    components = dict.fromkeys(COMPONENTS, 0)
    host = disk = 0
    report = {
        "reserved_bytes": 0,
        "peak_pages_bytes": 0,
        "peak_workspace_bytes": 0,
        "full_equivalent_bytes": 0,
        "stored_tokens": 0,
        "logical_tokens": 0,
    }
    if store is not None:
        held = store.memory_bytes()
        report["reserved_bytes"] = held["reserved"]
        if rows:
            components.update((name, held[name]) for name in STORE_COMPONENTS)
            host, disk = held["host"], held["disk"]
        report["peak_pages_bytes"] = store.peak_page_bytes
        report["peak_workspace_bytes"] = store.peak_workspace
    components["unpaged_state"] = state_bytes
    report["full_equivalent_bytes"] = state_bytes
    if rows:
        element = torch.empty((), dtype=store.dtype).element_size()
        for layer in range(shape.num_layers):
            heads = shape.layer_kv_heads[layer]
            report["stored_tokens"] += int(store.physical_lengths(layer, rows).sum())
            logical = store.logical_lengths(layer, rows)
            report["logical_tokens"] += int(logical.sum()) * heads
            window = shape.window(layer)
            kept = int((logical if window is None else logical.clamp(max=window - 1)).sum()) * heads
            report["full_equivalent_bytes"] += kept * (shape.layer_head_dims[layer] + shape.layer_value_dims[layer]) * element
    total = sum(components.values())
    by_tier = {"device": total - host - disk, "host": host, "disk": disk}
    report["slack_tokens"] = 0
    if evictor is not None and rows:
        report["slack_tokens"] = sum(
            evictor.over_cap(layer, store.physical_lengths(layer, rows).numpy()) for layer in range(shape.num_layers)
        )
    return {"total_bytes": total, "by_tier": by_tier, "by_component": components, **report}
