"""Uniform integer quantizers shared by the quantization strategies (not a strategy itself).

Asymmetric min/max quantization of a group ``x`` to ``bits`` bits: ``minimum`` is the group's
minimum rounded *down* to the metadata dtype, ``scale`` its range over ``2**bits - 1`` rounded
*up*, so the grid ``minimum + scale * [0, 2**bits)`` covers the whole group and every element
is within half a step (``scale / 2``) of its decoded value (before the decoded value is rounded
to the compute dtype). Codes are packed (:mod:`kvlib.storage.packing`); scales and minima are
metadata, stored in fp16 (bf16 for a bf16 compute dtype, whose range fp16 lacks).

Symmetric absmax quantization (int8): ``scale = max|x| / 127`` rounded up, codes
``round(x / scale)`` in ``[-127, 127]``; same half-step bound.
"""

from __future__ import annotations

import torch

from kvlib.codec import Field, TensorCodec, TensorShape
from kvlib.storage.packing import pack, packed_size, unpack


def metadata_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype scales and minima are stored in for a compute dtype."""
    return torch.bfloat16 if compute == torch.bfloat16 else torch.float16


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``dtype`` value ``<= x`` (elementwise; ``x`` float32)."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` value ``>= x`` (elementwise; ``x`` float32)."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def quantize_min_max(x: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups along the last dim of float32 ``x``: ``(codes uint8, scale, minimum)``,
    scale and minimum ``x.shape[:-1]`` in ``dtype``."""
    levels = (1 << bits) - 1
    minimum = round_down(x.amin(-1), dtype)
    span = (x.amax(-1) - minimum.float()) / levels
    scale = round_up(torch.nextafter(span, torch.full_like(span, float("inf"))), dtype)
    step = scale.float().unsqueeze(-1)
    codes = ((x - minimum.float().unsqueeze(-1)) / torch.where(step > 0, step, 1.0)).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale, minimum


def dequantize_min_max(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """float32 ``minimum + scale * codes`` (scale and minimum broadcast over the last dim)."""
    return torch.addcmul(minimum.float().unsqueeze(-1), codes.float(), scale.float().unsqueeze(-1))


class GroupQuantizer(TensorCodec):
    """Asymmetric ``bits``-bit quantization of pages ``[n, page_size, dim]``.

    ``per_channel=True``: each channel is one group across the page's tokens (KIVI's keys: the
    page is the token group). ``per_channel=False``: each token's channels split into groups of
    ``group`` (KIVI's values); ``group`` is clamped to ``dim`` and must then divide it.
    """

    def __init__(self, shape: TensorShape, bits: int, *, per_channel: bool, group: int = 0) -> None:
        super().__init__(shape)
        self.bits = bits
        self.per_channel = per_channel
        self.group = shape.page_size if per_channel else min(group, shape.dim)
        if not per_channel and shape.dim % self.group:
            raise ValueError(f"group {group} does not divide head_dim {shape.dim}; valid groups: {divisors(shape.dim)}")
        self.meta = metadata_dtype(shape.dtype)
        groups = (shape.dim,) if per_channel else (shape.page_size, shape.dim // self.group)
        self._count = shape.page_size * shape.dim
        self._fields = {
            "codes": Field((packed_size(self._count, bits),), torch.uint8),
            "scale": Field(groups, self.meta, metadata=True),
            "minimum": Field(groups, self.meta, metadata=True),
        }

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def _grouped(self, block: torch.Tensor) -> torch.Tensor:
        """``block [n, page_size, dim]`` as float32 groups ``[n, *groups, group]``."""
        n, size, dim = block.shape
        if self.per_channel:
            return block.float().transpose(1, 2)
        return block.float().view(n, size, dim // self.group, self.group)

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale, minimum = quantize_min_max(self._grouped(block), self.bits, self.meta)
        return {"codes": pack(codes.reshape(block.shape[0], -1), self.bits), "scale": scale, "minimum": minimum}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        n = encoded["codes"].shape[0]
        size, dim = self.shape.page_size, self.shape.dim
        codes = unpack(encoded["codes"], self.bits, self._count)
        if self.per_channel:
            values = dequantize_min_max(codes.view(n, dim, size), encoded["scale"], encoded["minimum"]).transpose(1, 2)
        else:
            values = dequantize_min_max(codes.view(n, size, dim // self.group, self.group), encoded["scale"], encoded["minimum"])
        return values.reshape(n, size, dim).to(self.shape.dtype)


class AbsmaxInt8(TensorCodec):
    """Symmetric int8 per token: one scale per token (``max|x| / 127``), codes in ``[-127, 127]``."""

    def __init__(self, shape: TensorShape) -> None:
        super().__init__(shape)
        self.meta = metadata_dtype(shape.dtype)
        self._fields = {
            "codes": Field((shape.page_size, shape.dim), torch.int8),
            "scale": Field((shape.page_size,), self.meta, metadata=True),
        }

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        x = block.float()
        scale = round_up(x.abs().amax(-1) / 127, self.meta)
        step = scale.float().unsqueeze(-1)
        codes = (x / torch.where(step > 0, step, 1.0)).round_().clamp_(-127, 127)
        return {"codes": codes.to(torch.int8), "scale": scale}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return (encoded["codes"].float() * encoded["scale"].float().unsqueeze(-1)).to(self.shape.dtype)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
