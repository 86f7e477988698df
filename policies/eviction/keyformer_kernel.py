"""Keyformer's Gumbel softmax fused into one CPU pass (numba): noise, logits and softmax per
query row, with no ``[heads, queries, slots]`` int64 temporaries. At a 4k-token prompt on
SmolLM2 the torch path (:func:`~kvlib.policies.eviction.keyformer.gumbel_noise` then a softmax)
spends ~20 tensor passes over 9 x 4096 x 4096 int64 values per layer; this kernel computes each
value once, in parallel over rows. The torch path stays the reference and the path on other
devices; ``tests/policies/eviction/test_keyformer_kernel.py`` checks that both agree.
"""

from __future__ import annotations

import math

import numba
import numpy as np

MIX_1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's multipliers
MIX_2 = np.uint64(0x94D049BB133111EB)
HEAD = np.uint64(0x9E3779B97F4A7C15)  # odd constants that spread each coordinate over 64 bits
QUERY = np.uint64(0xD1B54A32D192ED03)
KEY = np.uint64(0x8CB92BA72F3D8DD7)
"""The noise hash's constants, shared with the torch path (:mod:`.keyformer`)."""
_TOP_53 = np.uint64(11)
_SCALE = 1.0 / float(1 << 53)


@numba.njit(inline="always")
def _mixed(x: np.uint64) -> np.uint64:
    """splitmix64's finalizer (uint64 arithmetic wraps modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * MIX_1
    x = (x ^ (x >> np.uint64(27))) * MIX_2
    return x ^ (x >> np.uint64(31))


@numba.njit(parallel=True, cache=True)
def gumbel_softmax_rows(
    weights: np.ndarray,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    tau: np.ndarray,
    base: np.uint64,
    out: np.ndarray,
) -> None:
    """``out[b, h, i, :]`` = softmax over the seen slots (``weights > 0``) of ``(log w + g) / tau``,
    0 at the others and on rows that see nothing.

    ``weights`` float32 ``[batch, heads, queries, slots]``; ``query_positions`` int64 ``[batch,
    queries]``; ``key_positions`` int64 ``[batch, kv_heads, slots]`` (query head ``h`` reads KV head
    ``h // (heads // kv_heads)``); ``tau`` float32 ``[batch, queries]``; ``base`` the noise's
    ``splitmix64(seed) + layer``. The noise ``g`` of (head, query, key) is the top 53 bits of
    ``splitmix64(base + head * H + query * Q + key * K)`` plus a half, over ``2**53``, through
    ``-log(-log(u))``, rounded to float32 (as the torch path rounds it).
    """
    batch, heads, queries, slots = weights.shape
    group = heads // key_positions.shape[1]
    for row in numba.prange(batch * heads * queries):
        b = row // (heads * queries)
        h = (row // queries) % heads
        i = row % queries
        w = weights[b, h, i]
        o = out[b, h, i]
        keys = key_positions[b, h // group]
        spread = base + np.uint64(h) * HEAD + np.uint64(query_positions[b, i]) * QUERY
        inverse_tau = np.float32(1.0) / tau[b, i]
        top = -np.inf
        for s in range(slots):
            if w[s] > 0:
                bits = _mixed(spread + np.uint64(keys[s]) * KEY) >> _TOP_53
                noise = np.float32(-math.log(-math.log((float(bits) + 0.5) * _SCALE)))
                logit = (np.float32(math.log(w[s])) + noise) * inverse_tau
                o[s] = logit
                top = max(top, logit)
        total = 0.0
        for s in range(slots):
            if w[s] > 0:
                o[s] = math.exp(o[s] - top)
                total += o[s]
            else:
                o[s] = 0.0
        if total > 0:
            for s in range(slots):
                o[s] /= total
