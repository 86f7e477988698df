"""A sliding-window layer's tokens that no query will attend to again, freed after its attention.

``DynamicCache``'s sliding layers keep ``window - 1`` tokens; a kvlib cache layer that slides over
a window (:meth:`~kvlib.model_shape.KVShape.window`) drops, after each call's attention, every
stored token at a position ``<= seen - window`` (the next query, at position ``seen``, sees
``seen - window + 1`` onwards). Positions are logical (left padding included), as the model's
masks count them.
"""

from __future__ import annotations

import torch

from kvlib.adapters.cache.shared_state import SharedState
from kvlib.adapters.runtime.after_attention import drop_behind_window


def slide(cache: SharedState, layer_idx: int, seen: int) -> torch.Tensor | None:
    """Free the stored tokens of ``layer_idx`` that left its window once it has seen ``seen``
    tokens. Returns the store's layout (the compressor's per-slot state follows it), or None
    where nothing was dropped: a layer without a window, or one holding nothing past it."""
    window = cache.shape.window(layer_idx)
    if window is None or seen <= window - 1:
        return None
    return drop_behind_window(cache.store, cache.compressor, layer_idx, cache.rows, window, seen, reuse_slots=cache.reuse_slots)
