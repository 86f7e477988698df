"""Rotated: a randomized Hadamard rotation per KV head before KIVI-style codes (QuaRot / RotateKV)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.codec import PageCodec, TensorShape
from kvlib.params import Seed
from kvlib.policies.quantization.hadamard import MAX_HEADS, RotatedQuantizer, is_power_of_two
from kvlib.policies.quantization.kivi import check_group, check_value_groups
from kvlib.policies.quantization.uniform import GroupQuantizer
from kvlib.policy import Quantization
from kvlib.registry import register

ROTATED_BITS = (2, 3, 4, 8)
"""Bit widths of the codes (3-bit codes pack 8 to 3 bytes, :mod:`kvlib.kernels.packing`)."""
KEY_LAYOUTS = ("auto", "token", "channel")
"""Key quantization groups: ``group`` rotated channels of a token, or one channel across a page's
tokens (KIVI's); ``auto``: per token where keys get more bits than values, else per channel."""
MIN_KEY_BITS = 4
"""Default key bits are at least this (see :class:`Rotated`)."""


@register("rotated")
@dataclass
class Rotated(Quantization):
    """Keys and values rotated by a fixed randomized Hadamard matrix per (layer, KV head), then
    quantized asymmetrically (min/max with a zero point): values at ``bits`` in groups of
    ``group`` rotated channels per token, keys at ``key_bits`` (by default ``max(bits, 4)``) in
    the same per-token groups where they get more bits than values, else per channel across the
    page's tokens (KIVI's key layout).

    After Ashkboos et al., 2024 ("QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs"), Liu et
    al., 2024 ("SpinQuant") and Su et al., 2025 ("RotateKV"): ``R = H D / sqrt(d)`` (``D`` random
    signs, ``H`` Hadamard) is orthogonal, so attention scores are unchanged, and it spreads a
    key's outlier channels over all channels, so that a token's rotated channels share one range
    (rotate, then quantize per token, as QuaRot does). Keys carry most of the 2-bit loss
    (KV-AdaQuant; on SmolLM2 ``kv_bits(key_bits=2, value_bits=8)`` loses 4x what
    ``kv_bits(key_bits=8, value_bits=2)`` does), and per-token groups make 4-bit keys cheap: at
    a 16-token page and head dim 64, 4-bit keys and 2-bit values in groups of 64 take 4.5 + 2.5
    bits per element, what KIVI's 2-bit keys (2 + 2 bits of fp16 scale and minimum per channel
    per 16 tokens) and values in groups of 32 (2 + 1) take. So ``rotated(bits=2)`` stores what
    ``kivi(bits=2)`` stores, plus a head byte per
    page and the sign vectors (0.3% more on SmolLM2), at 0.45x its KL at 2k tokens
    (``benchmarks/results/rotated_smollm2.md``). At equal key and value bits, per-channel key
    groups over the rotated channels measured better than per-token ones (2 bits: KL 0.055
    against 0.148; 4 bits: 0.0026 against 0.0086, at 2k tokens), so ``rotated(bits=4)`` keeps
    them. The rotation is undone on every read (see
    :mod:`~kvlib.policies.quantization.hadamard`, which also decodes pages inside the
    paged-attention kernel). The open page stays in the compute dtype.

    Args:
        bits: bits per value element, 2, 3, 4 or 8 (codes packed 4, 2 or 1 per byte; 3-bit codes
            8 per 3 bytes).
        group: channels per quantization group (values, and keys with ``keys="token"``); clamped
            to the head dim, and must then divide it.
        seed: fixes the random signs (one vector per layer, keys or values, and KV head).
        key_bits: bits per key element (2, 3, 4 or 8); None: ``max(bits, 4)``.
        keys: key groups, ``"token"`` (``group`` rotated channels of a token), ``"channel"``
            (each rotated channel across the page's tokens, as KIVI's) or ``"auto"`` (per token
            where ``key_bits > bits``, else per channel).
    """

    bits: int = 2
    group: int = 64
    seed: Seed = 0
    key_bits: int | None = None
    keys: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in ROTATED_BITS:
            raise ValueError(f"bits must be one of {ROTATED_BITS}, got {self.bits!r}")
        if self.key_bits is not None and self.key_bits not in ROTATED_BITS:
            raise ValueError(f"key_bits must be one of {ROTATED_BITS} or None, got {self.key_bits!r}")
        if self.keys not in KEY_LAYOUTS:
            raise ValueError(f"keys must be one of {KEY_LAYOUTS}, got {self.keys!r}")
        check_group(self.group)

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        for key, value in shapes:
            for shape in (key, value):
                if not is_power_of_two(shape.dim):
                    raise ValueError(
                        f"rotated needs power-of-two head dims (a Hadamard rotation), got {shape.dim} (layer {shape.layer_idx})"
                    )
            if key.kv_heads > MAX_HEADS:
                raise ValueError(f"rotated serves at most {MAX_HEADS} KV heads, got {key.kv_heads}")
        check_value_groups(self.group, shapes)
        if not self._per_channel_keys():
            check_value_groups(self.group, [(value, key) for key, value in shapes])

    def _key_bits(self) -> int:
        return max(self.bits, MIN_KEY_BITS) if self.key_bits is None else self.key_bits

    def _per_channel_keys(self) -> bool:
        return self.keys == "channel" or (self.keys == "auto" and self._key_bits() <= self.bits)

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        key_bits, per_channel = self._key_bits(), self._per_channel_keys()
        return [
            PageCodec(
                RotatedQuantizer(GroupQuantizer(key, key_bits, per_channel=per_channel, group=self.group), self.seed, part=0),
                RotatedQuantizer(GroupQuantizer(value, self.bits, per_channel=False, group=self.group), self.seed, part=1),
                self.spec(),
            )
            for key, value in shapes
        ]
