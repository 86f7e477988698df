"""Keyformer: keep a recent window and the key tokens of an accumulated Gumbel-softmax score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvlib.params import Seed
from kvlib.policies.eviction import keyformer_kernel
from kvlib.policies.eviction.h2o import protected_scores
from kvlib.policy import Eviction, LayerView
from kvlib.registry import register


def _signed(constant: np.uint64) -> int:
    """A 64-bit constant of :mod:`.keyformer_kernel` as the int64 torch computes with (two's complement)."""
    return (int(constant) + (1 << 63)) % (1 << 64) - (1 << 63)


_MIX_1 = _signed(keyformer_kernel.MIX_1)  # splitmix64's multipliers
_MIX_2 = _signed(keyformer_kernel.MIX_2)
_HEAD = _signed(keyformer_kernel.HEAD)  # odd constants that spread each coordinate over 64 bits
_QUERY = _signed(keyformer_kernel.QUERY)
_KEY = _signed(keyformer_kernel.KEY)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``bits`` (as if unsigned)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mixed(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 ``x`` (arithmetic modulo 2**64, as two's complement wraps)."""
    x = (x ^ _shift(x, 30)) * _MIX_1
    x = (x ^ _shift(x, 27)) * _MIX_2
    return x ^ _shift(x, 31)


def noise_base(seed: int, layer: int) -> int:
    """``splitmix64(seed) + layer`` modulo ``2**64``, as an unsigned Python int: where the noise of a layer starts."""
    return (_mixed(torch.tensor(seed, dtype=torch.int64)).item() + layer) % (1 << 64)


def gumbel_softmax(weights: torch.Tensor, noise: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Float32 ``[batch, heads, queries, slots]``: per query row, the softmax of ``(log w + noise) /
    tau`` over the slots it sees (``weights > 0``); 0 at the others and on rows that see nothing.
    ``tau`` ``[batch, queries]``. The reference of :func:`.keyformer_kernel.gumbel_softmax_rows`."""
    seen = weights > 0
    logits = (weights.log() + noise) / tau.view(weights.shape[0], 1, -1, 1)
    return torch.softmax(logits.masked_fill(~seen, -torch.inf), dim=-1).nan_to_num(0.0)


def gumbel_noise(seed: int, layer: int, query_positions: torch.Tensor, key_positions: torch.Tensor, heads: int) -> torch.Tensor:
    """Float32 ``[batch, heads, queries, slots]`` standard Gumbel noise, a pure function of
    ``(seed, layer, query head, query position, key position)``: the same logit gets the same
    noise whatever the batch, the slot order or the block of queries it is computed in.

    ``query_positions`` int64 ``[batch, queries]``; ``key_positions`` int64 ``[batch, kv_heads,
    slots]`` (query heads grouped over KV heads as the model groups them). A uniform ``u`` in
    (0, 1) is the top 53 bits of ``splitmix64(splitmix64(seed) + layer + head * H + query * Q +
    key * K)`` plus one half, over ``2**53``; the noise is ``-log(-log(u))``.
    """
    batch, kv_heads, slots = key_positions.shape
    base = (noise_base(seed, layer) + (1 << 63)) % (1 << 64) - (1 << 63)  # wrapped to int64
    head = torch.arange(heads, device=key_positions.device).view(1, heads, 1, 1)
    keys = key_positions.repeat_interleave(heads // kv_heads, dim=1).unsqueeze(2)
    x = _mixed(base + head * _HEAD + query_positions.view(batch, 1, -1, 1) * _QUERY + keys * _KEY)
    uniform = (_shift(x, 11).to(torch.float64) + 0.5) / float(1 << 53)
    return (-torch.log(-torch.log(uniform))).float()


@register("keyformer")
@dataclass
class Keyformer(Eviction):
    """Keyformer (Adnan et al., 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection
    for Efficient Generative Inference"): each head keeps its ``recent`` newest tokens and the
    "key tokens" with the highest accumulated score, where each query adds the Gumbel softmax of
    its logits: ``softmax((x + g) / tau)`` over the stored tokens it sees (``x`` its attention
    logits, ``g`` standard Gumbel noise), averaged over the query heads of each KV group.

    The temperature rises linearly with the generation, as in the paper: prompt queries use
    ``tau_init``; the query of decode step ``t`` (the first generated token's query is ``t = 1``,
    counted from the row's prompt length) uses ``tau_init + t * (tau_end - tau_init) / steps``,
    held at ``tau_end`` after ``steps`` (the paper spreads the rise over the generation length).

    The noise is deterministic (:func:`gumbel_noise` of ``seed``, layer, head and both
    positions), so a run is reproducible and a padded row scores as it would alone. The logits
    are recovered from the attention weights (``log w`` differs from ``x`` by a constant per
    query, which the softmax cancels); tokens whose weight underflowed to 0 add 0.

    Decode-time eviction needs an int budget (``interval`` compacts every that many steps); a
    float budget compresses the prompt only, by the prompt queries' scores.

    Args:
        recent: newest tokens of each head always kept (tokens >= 0). Counts toward the budget.
        tau_init: temperature of the prompt queries (> 0; the paper: 1).
        tau_end: temperature reached after ``steps`` decode steps (>= tau_init; the paper: 2).
        steps: decode steps over which the temperature rises (>= 1).
        seed: seed of the Gumbel noise.
    """

    recent: int = 32
    tau_init: float = 1.0
    tau_end: float = 2.0
    steps: int = 128
    seed: Seed = 0
    reads_kv: ClassVar[bool] = False
    needs: ClassVar[frozenset[str]] = frozenset({"accumulated_attention", "prompt_length"})
    order_free: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0 (tokens), got {self.recent}")
        if not self.tau_init > 0:
            raise ValueError(f"tau_init must be > 0, got {self.tau_init}")
        if self.tau_end < self.tau_init:
            raise ValueError(f"tau_end must be >= tau_init ({self.tau_init}), got {self.tau_end}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1 (decode steps), got {self.steps}")

    def temperature(self, query_positions: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
        """Float32 ``[batch, queries]``: each query's tau (``tau_init`` for prompt and padding queries)."""
        step = (query_positions - prompt_lengths.to(query_positions.device).view(-1, 1) + 1).clamp(0, self.steps)
        return self.tau_init + step.float() * ((self.tau_end - self.tau_init) / self.steps)

    def attention_received(
        self,
        weights: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        prompt_lengths: torch.Tensor | None,
        layer_idx: int,
    ) -> torch.Tensor:
        """The Gumbel softmax of each query's logits over the slots it sees (0 elsewhere): fused in
        one numba pass on the CPU (:mod:`.keyformer_kernel`), torch ops elsewhere."""
        tau = self.temperature(query_positions, prompt_lengths).to(weights.device)
        if weights.device.type == "cpu":
            out = torch.empty(weights.shape, dtype=torch.float32)
            keyformer_kernel.gumbel_softmax_rows(
                weights.float().contiguous().numpy(),
                query_positions.contiguous().numpy(),
                key_positions.contiguous().numpy(),
                tau.contiguous().numpy(),
                np.uint64(noise_base(self.seed, layer_idx)),
                out.numpy(),
            )
            return out
        noise = gumbel_noise(self.seed, layer_idx, query_positions, key_positions, weights.shape[1]).to(weights.device)
        return gumbel_softmax(weights, noise, tau)

    def score(self, view: LayerView) -> torch.Tensor:
        """Accumulated Gumbel-softmax score; the recent window above every such score, newest highest."""
        return protected_scores(view.accumulated_attention.float(), view, recent=self.recent)
