"""fp8: keys and values stored as float8 e4m3 with one scale per page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.codec import CodedReader, Field, PageCodec, TensorCodec, TensorShape
from kvlib.registry import register
from kvlib.strategies.quantization.page_loaders import byte_table_reader
from kvlib.strategies.quantization.uniform import lookup_rows
from kvlib.strategy import Quantization
from kvlib.triton_readers import TritonReader

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float().numpy()
"""float32 value of every e4m3 bit pattern (encode never produces the two NaN patterns)."""


class PageScaledFP8(TensorCodec):
    """float8 e4m3 elements with one float32 scale per page (``max|x| / 448``): relative error
    at most 2**-4 for elements in e4m3's normal range, absolute ``scale * 2**-10`` below it."""

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

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return (encoded["codes"].float() * encoded["scale"].unsqueeze(-1)).to(self.shape.dtype)

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """On the CPU one fused kernel: bytes through a table of the 256 e4m3 values, times the page's scale."""
        if out.device.type != "cpu":
            super().decode_into(arenas, pages, heads, out, rows)
            return
        scale = arenas["scale"].index_select(0, pages).numpy()
        lookup_rows(arenas["codes"].view(torch.uint8), pages, E4M3_TABLE, scale, out, rows)

    def page_reader(self, arenas: dict[str, torch.Tensor]) -> CodedReader:
        """Bytes through the e4m3 table times the page's scale, page by page inside the kernel."""
        return byte_table_reader(arenas["codes"], E4M3_TABLE, arenas["scale"])

    def triton_reader(self, arenas: dict[str, torch.Tensor]) -> TritonReader:
        """e4m3 bit patterns widened to float32 times the page's scale, in registers inside the Triton kernel."""
        from kvlib.strategies.quantization.triton_loaders.scaled_bytes import load_e4m3, scaled_bytes_triton_reader  # triton is optional

        return scaled_bytes_triton_reader(load_e4m3, arenas["codes"], arenas["scale"])


@register("fp8")
@dataclass
class FP8(Quantization):
    """float8 (e4m3) storage of keys and values with one scale per page and head, as fp8 KV
    caches in vLLM and TensorRT-LLM do with per-tensor scales; here the scale follows each page,
    so an outlier page does not flatten the others. Uses torch's ``float8_e4m3fn``. No parameters.
    """

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return [PageCodec(PageScaledFP8(key), PageScaledFP8(value), self.spec()) for key, value in shapes]
