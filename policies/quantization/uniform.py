"""Uniform integer quantizers shared by the quantization policies (not a policy itself).

Asymmetric min/max quantization of a group ``x`` to ``bits`` bits: ``minimum`` is the group's
minimum rounded *down* to the metadata dtype, ``scale`` its range over ``2**bits - 1`` rounded
*up*, so the grid ``minimum + scale * [0, 2**bits)`` covers the whole group and every element
is within half a step (``scale / 2``) of its decoded value (before the decoded value is rounded
to the compute dtype). Codes are packed (:mod:`kvlib.kernels.packing`); scales and minima are
metadata, stored in fp16 (bf16 for a bf16 compute dtype, whose range fp16 lacks); a float32
model's keys or values beyond fp16's range (|x| > 65504, which do not occur in practice) saturate.

On the CPU the group quantizer runs fused numba kernels (:mod:`.kernels`); elsewhere the torch
code here, which is also their reference.

Symmetric absmax quantization (int8): ``scale = max|x| / 127`` rounded up, codes
``round(x / scale)`` in ``[-127, 127]``; same half-step bound.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from kvlib.codec import Field, TensorCodec, TensorShape
from kvlib.kernel_readers import KernelReader
from kvlib.kernels.packing import pack, packed_size, unpack
from kvlib.policies.quantization import kernels
from kvlib.policies.quantization.page_readers import INT8_CODES
from kvlib.policies.quantization.triton_loaders import register_triton_loaders


def metadata_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype scales and minima are stored in for a compute dtype."""
    return torch.bfloat16 if compute == torch.bfloat16 else torch.float16


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``dtype`` value ``<= x`` (elementwise; ``x`` float32), saturating at ``dtype``'s
    finite range (values beyond it, which fp16 metadata cannot hold, decode clamped, not inf)."""
    y = x.to(dtype)
    y = torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)
    return y.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` value ``>= x`` (elementwise; ``x`` float32), saturating like :func:`round_down`."""
    y = x.to(dtype)
    y = torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max)


def grid(low: torch.Tensor, high: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, minimum)`` in ``dtype`` of groups spanning float32 ``[low, high]``: the grid
    ``minimum + scale * [0, 2**bits)`` covers the span."""
    minimum = round_down(low, dtype)
    span = (high - minimum.float()) / ((1 << bits) - 1)
    return round_up(torch.nextafter(span, torch.full_like(span, float("inf"))), dtype), minimum


def quantize_min_max(x: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups along the last dim of float32 ``x``: ``(codes uint8, scale, minimum)``,
    scale and minimum ``x.shape[:-1]`` in ``dtype``."""
    levels = (1 << bits) - 1
    scale, minimum = grid(x.amin(-1), x.amax(-1), bits, dtype)
    step = scale.float().unsqueeze(-1)
    inverse = torch.where(step > 0, 1.0 / step, 0.0)
    codes = ((x - minimum.float().unsqueeze(-1)) * inverse).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale, minimum


def dequantize_min_max(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """float32 ``minimum + scale * codes`` (scale and minimum broadcast over the last dim)."""
    return torch.addcmul(minimum.float().unsqueeze(-1), codes.float(), scale.float().unsqueeze(-1))


def group_size(shape: TensorShape, per_channel: bool, group: int) -> int:
    """Elements per quantization group of a page ``[page_size, dim]``: its ``page_size`` tokens
    for ``per_channel`` (one group a channel), else ``group`` clamped to ``dim``, which it must
    then divide (ValueError naming the valid groups)."""
    if per_channel:
        return shape.page_size
    size = min(group, shape.dim)
    if shape.dim % size:
        raise ValueError(f"group {group} does not divide head_dim {shape.dim}; valid groups: {divisors(shape.dim)}")
    return size


class GroupQuantizer(TensorCodec):
    """Asymmetric ``bits``-bit quantization of pages ``[n, page_size, dim]``.

    ``per_channel=True``: each channel is one group across the page's tokens (KIVI's keys: the
    page is the token group). ``per_channel=False``: each token's channels split into groups of
    ``group`` (KIVI's values); ``group`` is clamped to ``dim`` and must then divide it. Codes are
    packed in the page's token-major element order whatever the grouping.
    """

    def __init__(self, shape: TensorShape, bits: int, *, per_channel: bool, group: int = 0) -> None:
        super().__init__(shape)
        self.bits = bits
        self.per_channel = per_channel
        self.group = group_size(shape, per_channel, group)
        self.meta = metadata_dtype(shape.dtype)
        self._count = shape.page_size * shape.dim
        self._kernels = kernels.fits(bits, self._count)
        """Whether the fused CPU kernels serve this layout (a page's codes fill whole bytes)."""
        groups = (shape.dim,) if per_channel else (shape.page_size, shape.dim // self.group)
        self._fields = {
            "codes": Field((packed_size(self._count, bits),), torch.uint8),
            "scale": Field(groups, self.meta, metadata=True),
            "minimum": Field(groups, self.meta, metadata=True),
        }

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        n = block.shape[0]
        groups = self._fields["scale"].shape
        if block.device.type == "cpu" and self._kernels:
            x = block.float().reshape(n, -1).contiguous().numpy()
            low = np.empty((n, math.prod(groups)), dtype=np.float32)
            high = np.empty_like(low)
            if self.per_channel:
                kernels.min_max_cols(x, self.shape.dim, low, high)
            else:
                kernels.min_max_rows(x, self.group, low, high)
            scale, minimum = grid(torch.from_numpy(low), torch.from_numpy(high), self.bits, self.meta)
            codes = np.empty((n, self._fields["codes"].shape[0]), dtype=np.uint8)
            kernels.quantize_pack(self.bits, self.per_channel)(x, scale.float().numpy(), minimum.float().numpy(), self.shape.dim, codes)
            return {"codes": torch.from_numpy(codes), "scale": scale.view(n, *groups), "minimum": minimum.view(n, *groups)}
        x = block.float()
        if self.per_channel:  # groups along the tokens: quantize the transposed page, keep codes token-major
            codes, scale, minimum = quantize_min_max(x.transpose(1, 2), self.bits, self.meta)
            codes = codes.transpose(1, 2)
        else:
            codes, scale, minimum = quantize_min_max(x.view(n, self.shape.page_size, -1, self.group), self.bits, self.meta)
        return {"codes": pack(codes.reshape(n, -1), self.bits), "scale": scale, "minimum": minimum}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        n = encoded["codes"].shape[0]
        size, dim = self.shape.page_size, self.shape.dim
        if encoded["codes"].device.type == "cpu" and self._kernels:
            out = torch.empty(n, size, dim, dtype=self.shape.dtype)
            rows = torch.arange(n)
            self.decode_into(encoded, rows, heads, out, rows)
            return out
        return self.dequantize(encoded).to(self.shape.dtype)

    def dequantize(self, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 ``[pages, page_size, dim]`` of encoded pages, before rounding to the compute
        dtype (the fused kernel on the CPU, torch elsewhere)."""
        n = encoded["codes"].shape[0]
        size, dim = self.shape.page_size, self.shape.dim
        if encoded["codes"].device.type == "cpu" and self._kernels:
            out = torch.empty(n, size, dim, dtype=torch.float32)
            rows = torch.arange(n)
            self.decode_into(encoded, rows, torch.zeros_like(rows), out, rows)  # heads: unused by a group quantizer
            return out
        codes = unpack(encoded["codes"], self.bits, self._count)
        if self.per_channel:
            values = dequantize_min_max(codes.view(n, size, dim).transpose(1, 2), encoded["scale"], encoded["minimum"]).transpose(1, 2)
        else:
            values = dequantize_min_max(codes.view(n, size, dim // self.group, self.group), encoded["scale"], encoded["minimum"])
        return values.reshape(n, size, dim)

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """On the CPU one fused kernel reads the codes where they are stored and writes ``out[rows]``."""
        if out.device.type != "cpu" or not self._kernels:
            super().decode_into(arenas, pages, heads, out, rows)
            return
        m = pages.numel()
        scale = arenas["scale"].index_select(0, pages).float().reshape(m, -1).numpy()
        minimum = arenas["minimum"].index_select(0, pages).float().reshape(m, -1).numpy()
        kernel = kernels.unpack_dequantize(self.bits, self.per_channel)
        codes = arenas["codes"].numpy()
        if out.dtype == torch.float32:
            kernel(codes, pages.numpy(), scale, minimum, out.view(out.shape[0], -1).numpy(), rows.numpy())
            return
        decoded = np.empty((m, self._count), dtype=np.float32)
        kernel(codes, pages.numpy(), scale, minimum, decoded, np.arange(m))
        write_rows(out, rows, torch.from_numpy(decoded).view(m, *out.shape[1:]))

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"group"``: the codes read where they are stored, per-channel scales folded into the
        query (:mod:`~.page_readers`); on CUDA decoded in registers (:mod:`~.triton_loaders.group`)."""
        register_triton_loaders(arenas["codes"].device)
        fields = (arenas["codes"], arenas["scale"], arenas["minimum"])
        return KernelReader("group", fields, (self.bits, int(self.per_channel), self.group))


INT8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).float().numpy()
"""float32 value of every int8 bit pattern, indexed by the pattern as a byte."""


class ScaledBytes(TensorCodec):
    """A codec of one byte per element (field ``codes``) and a scale per run of elements (field
    ``scale``, float metadata, one per page or per token): an element decodes as
    ``TABLE[byte] * scale``, ``TABLE`` being the float32 value of each of the 256 bit patterns.
    Subclasses give the table, the kind of their codes for the kernels' readers, their fields and
    encoding."""

    TABLE: ClassVar[np.ndarray]
    CODES: ClassVar[int]
    """How the kernels' readers widen a code: :data:`~.page_readers.INT8_CODES` or :data:`~.page_readers.E4M3_CODES`."""

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return (encoded["codes"].float() * encoded["scale"].float().unsqueeze(-1)).to(self.shape.dtype)

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """On the CPU one fused kernel (bytes through :attr:`TABLE`, times their scale)."""
        if out.device.type != "cpu":
            super().decode_into(arenas, pages, heads, out, rows)
            return
        scale = arenas["scale"].index_select(0, pages).float().numpy()
        lookup_rows(arenas["codes"].view(torch.uint8), pages, self.TABLE, scale, out, rows)

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"scaled_bytes"``: the bytes widened where they are stored, a key's scale multiplying
        its score (:mod:`~.page_readers`); on CUDA in registers (:mod:`~.triton_loaders.scaled_bytes`).
        Params: the code kind (:attr:`CODES`) and the elements per scale."""
        codes, scale = arenas["codes"], arenas["scale"]
        register_triton_loaders(codes.device)
        run = math.prod(codes.shape[1:]) // math.prod(scale.shape[1:])
        return KernelReader("scaled_bytes", (codes, scale), (self.CODES, run))


class AbsmaxInt8(ScaledBytes):
    """Symmetric int8 per token: one scale per token (``max|x| / 127``), codes in ``[-127, 127]``."""

    TABLE = INT8_TABLE
    CODES = INT8_CODES

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
        if block.device.type == "cpu":
            x = block.float().reshape(-1, self.shape.dim).contiguous().numpy()
            absmax = np.empty(x.shape[0], dtype=np.float32)
            kernels.row_absmax(x, absmax)
            scale = round_up(torch.from_numpy(absmax) / 127, self.meta)
            codes = np.empty(x.shape, dtype=np.int8)
            kernels.quantize_symmetric(x, scale.float().numpy(), codes)
            return {"codes": torch.from_numpy(codes).view(block.shape), "scale": scale.view(block.shape[:2])}
        x = block.float()
        scale = round_up(x.abs().amax(-1) / 127, self.meta)
        step = scale.float().unsqueeze(-1)
        inverse = torch.where(step > 0, 1.0 / step, 0.0)
        codes = (x * inverse).round_().clamp_(-127, 127)
        return {"codes": codes.to(torch.int8), "scale": scale}


def lookup_rows(
    codes: torch.Tensor, pages: torch.Tensor, table: np.ndarray, scale: np.ndarray, out: torch.Tensor, rows: torch.Tensor
) -> None:
    """``out[rows]`` = ``table[byte] * scale`` for the one-byte codes of arena rows ``pages``
    (CPU; ``scale`` float32 ``[pages, groups]``, each group a run of equal length)."""
    flat_codes = codes.reshape(codes.shape[0], -1).numpy()
    m, count = pages.numel(), flat_codes.shape[1]
    if out.dtype == torch.float32:
        kernels.scaled_lookup(flat_codes, pages.numpy(), table, scale, out.view(out.shape[0], -1).numpy(), rows.numpy())
        return
    decoded = np.empty((m, count), dtype=np.float32)
    kernels.scaled_lookup(flat_codes, pages.numpy(), table, scale, decoded, np.arange(m))
    write_rows(out, rows, torch.from_numpy(decoded).view(m, *out.shape[1:]))


def write_rows(out: torch.Tensor, rows: torch.Tensor, decoded: torch.Tensor) -> None:
    """``out[rows] = decoded`` converting to ``out``'s dtype in the same pass: each run of
    consecutive rows (a head's pages, in a read) is one ``copy_``."""
    if rows.numel() == 0:
        return
    breaks = (rows[1:] != rows[:-1] + 1).nonzero().squeeze(-1) + 1
    if breaks.numel() > 64:  # scattered rows: one conversion, one indexed copy
        out.index_copy_(0, rows, decoded.to(out.dtype))
        return
    starts = [0, *breaks.tolist(), rows.numel()]
    first_rows = rows[starts[:-1]].tolist()
    for begin, end, row in zip(starts[:-1], starts[1:], first_rows):
        out[row : row + end - begin].copy_(decoded[begin:end])


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
