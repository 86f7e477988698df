"""Mixed precision by token salience (ZipCache, QAQ): salient tokens keep more bits."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.codec import TensorShape
from kvlib.policies.quantization.kivi import check_bits, check_group, check_value_groups
from kvlib.policies.quantization.mixed_codec import MixedPageCodec, MixedQuantizer
from kvlib.policies.quantization.salience import NormalizedAttention
from kvlib.policy import Eviction, Quantization
from kvlib.registry import register


@register("mixed")
@dataclass
class MixedPrecision(Quantization):
    """Salient tokens at ``high_bits``, the rest at ``low_bits`` (ZipCache: He et al., 2024,
    "ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token Identification";
    QAQ: Dong et al., 2024, "QAQ: Quality Adaptive Quantization for LLM KV Cache").

    Salience is a score per stored token, handed to the codec when a page is sealed: with an
    eviction policy in the spec (``"h2o+mixed"``, ``"snapkv+mixed"``) its keep-scores decide;
    alone, ZipCache's normalized attention score
    (:class:`~kvlib.policies.quantization.salience.NormalizedAttention`: accumulated attention
    over the number of queries that saw the token). ZipCache ranks tokens over the whole cache;
    a page here has fixed-size fields, so each sealed page keeps its own ``round(salient *
    page_size)`` highest-scored tokens at ``high_bits`` (a page of 16 tokens at the default 0.1:
    2 tokens). Keys and values share the page's salient tokens.

    Layout (:mod:`~kvlib.policies.quantization.mixed_codec`): KIVI's grouping and metadata (keys
    per channel across the page's tokens, one grid whose span salient keys cut into
    ``2**high_bits - 1`` steps; values per token in groups of ``group`` channels, each token's
    grid at its own bits), the salient slots (one byte each), and the codes packed by width.
    Bytes per page and tensor: KIVI's metadata + ``count + (count * high_bits + (page_size -
    count) * low_bits) * dim / 8``; e.g. SmolLM2 (head dim 64, 16-token pages), 8/2 bits at 0.25:
    1288 bytes for keys and values, against 1408 for ``kivi(bits=4)`` and 896 for ``kivi(bits=2)``.

    Args:
        high_bits: bits of a salient token's codes (2, 3, 4 or 8).
        low_bits: bits of the other tokens' codes (2, 3, 4 or 8; at most ``high_bits``).
        salient: fraction of each page's tokens kept at ``high_bits``, in [0, 1].
        group: value channels per quantization group, as :class:`~.kivi.KIVI`'s.
    """

    high_bits: int = 8
    low_bits: int = 2
    salient: float = 0.1
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits("high_bits", self.high_bits)
        check_bits("low_bits", self.low_bits)
        check_group(self.group)
        if self.low_bits > self.high_bits:
            raise ValueError(f"low_bits ({self.low_bits}) must not exceed high_bits ({self.high_bits})")
        if not 0.0 <= self.salient <= 1.0:
            raise ValueError(f"salient must be a fraction in [0, 1], got {self.salient!r}")

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        check_value_groups(self.group, shapes)

    def salient_count(self, page_size: int) -> int:
        """Salient tokens per page of ``page_size`` tokens: ``round(salient * page_size)``."""
        return round(self.salient * page_size)

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[MixedPageCodec]:
        codecs = []
        for key, value in shapes:
            count = self.salient_count(key.page_size)
            codecs.append(
                MixedPageCodec(
                    MixedQuantizer(key, self.high_bits, self.low_bits, count, per_channel=True),
                    MixedQuantizer(value, self.high_bits, self.low_bits, count, per_channel=False, group=self.group),
                    self.spec(),
                )
            )
        return codecs

    def salience_scorer(self) -> Eviction:
        return NormalizedAttention()
