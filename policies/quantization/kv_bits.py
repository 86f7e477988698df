"""Asymmetric K/V bits: KIVI's layout with different bits for keys and values."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.codec import PageCodec, TensorShape
from kvlib.policies.quantization.kivi import check_bits, check_group, check_value_groups, kivi_codecs
from kvlib.policy import Quantization
from kvlib.registry import register


@register("kv_bits")
@dataclass
class KVBits(Quantization):
    """Different precision for keys and values (KV-AdaQuant, Hariri et al., 2025: keys carry the
    attention pattern and need more bits; K4V2 keeps far more quality than K2V4 at equal bytes).

    Same layout as :class:`~kvlib.policies.quantization.kivi.KIVI`: keys per channel across the
    page's tokens, values per token in groups of ``group`` channels, asymmetric.

    Args:
        key_bits: bits per key element (2, 3, 4 or 8).
        value_bits: bits per value element (2, 3, 4 or 8).
        group: value channels per group (clamped to the head dim, must then divide it).
    """

    key_bits: int = 4
    value_bits: int = 2
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits("key_bits", self.key_bits)
        check_bits("value_bits", self.value_bits)
        check_group(self.group)

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        check_value_groups(self.group, shapes)

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return kivi_codecs(self.key_bits, self.value_bits, self.group, shapes, self.spec())
