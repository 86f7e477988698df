"""KIVI: keys quantized per channel, values per token, asymmetric, 2, 3, 4 or 8 bits."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.codec import PageCodec, TensorShape
from kvlib.policies.quantization.uniform import GroupQuantizer, divisors
from kvlib.policy import Quantization
from kvlib.registry import register

KIVI_BITS = (2, 3, 4, 8)
"""Bit widths of the KIVI-layout codecs (3-bit codes pack 8 to 3 bytes, :mod:`kvlib.kernels.packing`)."""


@register("kivi")
@dataclass
class KIVI(Quantization):
    """KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

    Keys have outlier *channels*, so each key channel is quantized across the tokens of a page
    (the page is KIVI's token group: ``page_size`` tokens); values are quantized per token in
    groups of ``group`` channels. Both are asymmetric (min/max with a zero point, see
    :mod:`kvlib.policies.quantization.uniform`). The open page stays in the compute dtype: KIVI's
    full-precision residual window.

    Args:
        bits: bits per element, 2, 3, 4 or 8 (codes packed 4, 2 or 1 per byte; 3-bit codes 8 per 3 bytes).
        group: value channels per quantization group; clamped to the head dim (a head dim
            of 8 gives groups of 8), and must then divide it.
    """

    bits: int = 2
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits("bits", self.bits)
        check_group(self.group)

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        check_value_groups(self.group, shapes)

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return kivi_codecs(self.bits, self.bits, self.group, shapes, self.spec())


def kivi_codecs(key_bits: int, value_bits: int, group: int, shapes: list[tuple[TensorShape, TensorShape]], name: str) -> list[PageCodec]:
    """One KIVI-layout codec per layer: keys per channel at ``key_bits``, values per token group at ``value_bits``."""
    return [
        PageCodec(
            GroupQuantizer(key, key_bits, per_channel=True),
            GroupQuantizer(value, value_bits, per_channel=False, group=group),
            name,
        )
        for key, value in shapes
    ]


def check_bits(name: str, bits: int) -> None:
    if bits not in KIVI_BITS:
        raise ValueError(f"{name} must be one of {KIVI_BITS}, got {bits!r}")


def check_group(group: int) -> None:
    if group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")


def check_value_groups(group: int, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
    """``ValueError`` unless ``group`` (clamped to the value dim) divides every layer's value dim."""
    for _, value in shapes:
        size = min(group, value.dim)
        if value.dim % size:
            raise ValueError(
                f"group={group} does not divide the value head dim {value.dim} (layer {value.layer_idx});"
                f" valid groups for it: {divisors(value.dim)} or any multiple of {value.dim}"
            )
