"""GEAR: uniform codes, a low-rank approximation of their residual, and sparse outliers kept exact."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlib.codec import PageCodec, TensorShape
from kvlib.policies.quantization.gear_codec import GearQuantizer
from kvlib.policies.quantization.kivi import check_bits, check_group, check_value_groups
from kvlib.policy import Quantization
from kvlib.registry import register


@register("gear")
@dataclass
class GEAR(Quantization):
    """GEAR (Kang et al., 2024, "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless
    Generative Inference of LLM"), page by page: a sealed page ``X [page_size, dim]`` is stored as

    - ``S``: a fixed number of outlier entries, taken from ``X`` before quantization and kept
      exact (their compute value in the metadata dtype, fp16 or bf16, with a uint16-range index);
    - ``D``: KIVI's uniform codes of ``X`` with the outliers taken out (keys per channel across the
      page's tokens, values per token in groups of ``group`` channels);
    - ``L = U V^T``: a rank-``rank`` approximation of the residual ``X - D - S``, found by power
      (subspace) iteration, factors ``U [page_size, rank]`` and ``V [dim, rank]`` in fp16 (bf16).

    Decoding is ``D + U V^T`` with the outliers written back. GEAR filters the top and bottom
    ``s/2`` per cent of each vector; a page here has a fixed outlier count (the codec contract's
    fixed per-page fields), ``ceil(outliers * page_size * dim)``, fewer than one per quantization
    group at the default, so the outliers are the entries whose removal narrows their group's
    range the most (see :func:`~.gear_codec.narrowing_outliers`).

    Bytes: per page and tensor, ``rank * (page_size + dim)`` factor values and ``count`` (index,
    value) pairs on top of KIVI's. The defaults keep a 16-token, head-dim-64 page (SmolLM2) within
    1.25x ``kivi(bits=4)``: GEAR's rank 4 would cost 1.9x there, since each 16-token page carries
    its own factors.

    Args:
        bits: bits per code, 2, 3, 4 or 8.
        rank: rank of the residual's approximation per page (0: none).
        outliers: fraction of a page's entries kept exact, in ``[0, 0.5)`` (0: none).
        group: value channels per quantization group, as :class:`~.kivi.KIVI`'s.
        iterations: power iterations of the low-rank fit (>= 1).
    """

    bits: int = 4
    rank: int = 1
    outliers: float = 0.003
    group: int = 32
    iterations: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits("bits", self.bits)
        check_group(self.group)
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {self.rank!r}")
        if not isinstance(self.outliers, (int, float)) or not 0 <= self.outliers < 0.5:
            raise ValueError(f"outliers must be a fraction in [0, 0.5), got {self.outliers!r}")
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations must be an int >= 1, got {self.iterations!r}")

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        check_value_groups(self.group, shapes)
        for key, value in shapes:
            for shape in (key, value):
                if self.rank > min(shape.page_size, shape.dim):
                    raise ValueError(f"rank={self.rank} exceeds min(page_size, head dim) = {min(shape.page_size, shape.dim)}")

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return [PageCodec(self._quantizer(key, True), self._quantizer(value, False), self.spec()) for key, value in shapes]

    def _quantizer(self, shape: TensorShape, per_channel: bool) -> GearQuantizer:
        count = math.ceil(self.outliers * shape.page_size * shape.dim)
        return GearQuantizer(shape, self.bits, per_channel, self.group, self.rank, count, self.iterations)
