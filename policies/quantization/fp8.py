"""fp8: keys and values stored as float8 e4m3 with one scale per page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.codec import Field, PageCodec, TensorShape
from kvlib.policies.quantization.page_readers import E4M3_CODES
from kvlib.policies.quantization.uniform import ScaledBytes
from kvlib.policy import Quantization
from kvlib.registry import register

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float().numpy()
"""float32 value of every e4m3 bit pattern (encode never produces the two NaN patterns)."""


class PageScaledFP8(ScaledBytes):
    """float8 e4m3 elements with one float32 scale per page (``max|x| / 448``): relative error
    at most 2**-4 for elements in e4m3's normal range, absolute ``scale * 2**-10`` below it."""

    TABLE = E4M3_TABLE
    CODES = E4M3_CODES

    def __init__(self, shape: TensorShape) -> None:
        super().__init__(shape)
        self._fields = {
            "codes": Field((shape.page_size, shape.dim), E4M3),
            "scale": Field((1,), torch.float32, metadata=True),
        }

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = block.flatten(1)
        amax = torch.maximum(flat.amax(-1, keepdim=True), -flat.amin(-1, keepdim=True)).float()
        scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
        codes = torch.div(block, scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)  # float32 by promotion
        return {"codes": codes, "scale": scale}


@register("fp8")
@dataclass
class FP8(Quantization):
    """float8 (e4m3) storage of keys and values with one scale per page and head, as fp8 KV
    caches in vLLM and TensorRT-LLM do with per-tensor scales; here the scale follows each page,
    so an outlier page does not flatten the others. Uses torch's ``float8_e4m3fn``. No parameters.
    """

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return [PageCodec(PageScaledFP8(key), PageScaledFP8(value), self.spec()) for key, value in shapes]
