"""int8: symmetric per-token absmax quantization of keys and values."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.codec import PageCodec, TensorShape
from kvlib.policies.quantization.uniform import AbsmaxInt8
from kvlib.policy import Quantization
from kvlib.registry import register


@register("int8")
@dataclass
class Int8(Quantization):
    """Symmetric int8 per token (LLM.int8-style absmax, the simple strong baseline of the KV
    quantization literature): every token of every head gets one scale ``max|x| / 127`` for its
    keys and one for its values; codes are int8 in ``[-127, 127]``. No parameters.
    """

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return [PageCodec(AbsmaxInt8(key), AbsmaxInt8(value), self.spec()) for key, value in shapes]
