"""The mixed-precision tensor and page codecs (not a policy themselves; see :mod:`.mixed`): each
sealed page keeps its ``count`` most salient tokens at ``high_bits`` and the rest at ``low_bits``.

Layout of one page of one tensor (keys or values), every field fixed-size per page:

- ``salient`` ``[count]``: the salient tokens' slots in the page, ascending (uint8 for pages of
  at most 256 tokens, else int16);
- ``high_codes``: the salient tokens' codes at ``high_bits``, token-major, packed;
- ``low_codes``: the other ``page_size - count`` tokens' codes at ``low_bits``, token-major in
  slot order, packed;
- ``scale``, ``minimum``: KIVI's metadata (:class:`~.uniform.GroupQuantizer`'s grouping). Keys
  (``per_channel``): one min/max grid per channel over all the page's tokens, ``scale`` its step
  at ``low_bits``; a salient token's step is ``scale * (2**low_bits - 1) / (2**high_bits - 1)``:
  the same span cut finer. Values (per token, groups of ``group`` channels): each token's groups
  have their own grid at that token's bits.

Invariants: every decoded element is within half a step of its input (the step of its token's
bits: ``scale`` for low tokens, the finer step for salient ones; before rounding to the compute
dtype); bytes per page and tensor are ``count * salient_bytes + packed(count * dim, high_bits) +
packed((page_size - count) * dim, low_bits)`` plus KIVI's metadata (:meth:`PageCodec.page_bytes`).
"""

from __future__ import annotations

import torch

from kvlib.codec import Field, PageCodec, TensorCodec, TensorShape
from kvlib.devices import to_arena_device
from kvlib.kernel_readers import KernelReader
from kvlib.kernels.packing import pack, packed_size, unpack
from kvlib.policies.quantization.mixed_loader import READER
from kvlib.policies.quantization.uniform import grid, group_size, metadata_dtype


class MixedQuantizer(TensorCodec):
    """Pages ``[n, page_size, dim]`` with ``count`` salient tokens per page at ``high_bits``, the
    others at ``low_bits`` (see the module docstring). ``per_channel`` and ``group`` group as
    :class:`~.uniform.GroupQuantizer`'s (``group`` clamped to ``dim``, must then divide it).

    :meth:`encode` alone (no salience given) takes a page's tokens of largest norm as salient;
    :class:`MixedPageCodec` hands both tensors the same salient slots (:meth:`encode_salient`).
    """

    def __init__(self, shape: TensorShape, high_bits: int, low_bits: int, count: int, *, per_channel: bool, group: int = 0) -> None:
        super().__init__(shape)
        if not 0 <= count <= shape.page_size:
            raise ValueError(f"salient tokens per page must be in [0, {shape.page_size}], got {count}")
        self.high_bits = high_bits
        self.low_bits = low_bits
        self.count = count
        self.per_channel = per_channel
        self.group = group_size(shape, per_channel, group)
        self.meta = metadata_dtype(shape.dtype)
        self.ratio = ((1 << low_bits) - 1) / ((1 << high_bits) - 1)
        """A salient key's step over the channel's ``scale``: the same span in ``2**high_bits - 1`` steps."""
        size, dim = shape.page_size, shape.dim
        groups = (dim,) if per_channel else (size, dim // self.group)
        self._fields: dict[str, Field] = {}
        if count:
            self._fields["salient"] = Field((count,), torch.uint8 if size <= 256 else torch.int16)
            self._fields["high_codes"] = Field((packed_size(count * dim, high_bits),), torch.uint8)
        if count < size:
            self._fields["low_codes"] = Field((packed_size((size - count) * dim, low_bits),), torch.uint8)
        self._fields["scale"] = Field(groups, self.meta, metadata=True)
        self._fields["minimum"] = Field(groups, self.meta, metadata=True)

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        """Salient tokens: each page's ``count`` tokens of largest norm (no scores given)."""
        return self.encode_salient(block, salient_slots(block.float().norm(dim=-1), self.count))

    def encode_salient(self, block: torch.Tensor, salient: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode ``block [n, page_size, dim]`` keeping tokens ``salient`` (int64 ``[n, count]``,
        ascending slots, on ``block``'s device) at ``high_bits``."""
        x = block.float()
        n, size, dim = x.shape
        high = _high_mask(salient, n, size)
        if self.per_channel:
            scale, minimum = grid(x.amin(1), x.amax(1), self.low_bits, self.meta)  # [n, dim]
            step = torch.where(high.unsqueeze(-1), scale.float().unsqueeze(1) * self.ratio, scale.float().unsqueeze(1))
            base = minimum.float().unsqueeze(1)
        else:
            grouped = x.view(n, size, dim // self.group, self.group)
            low, top = grouped.amin(-1), grouped.amax(-1)
            scale_low, minimum = grid(low, top, self.low_bits, self.meta)
            scale_high, _ = grid(low, top, self.high_bits, self.meta)
            scale = torch.where(high.unsqueeze(-1), scale_high, scale_low)  # [n, size, groups]
            step = scale.float().repeat_interleave(self.group, dim=-1)
            base = minimum.float().repeat_interleave(self.group, dim=-1)
        levels = torch.where(high, (1 << self.high_bits) - 1, (1 << self.low_bits) - 1).unsqueeze(-1).to(x.dtype)
        inverse = torch.where(step > 0, 1.0 / step, 0.0)
        codes = ((x - base) * inverse).round_().clamp_(min=0).minimum(levels).to(torch.uint8)
        encoded = {"scale": scale, "minimum": minimum}
        if self.count:
            encoded["salient"] = salient.to(self._fields["salient"].dtype)
            encoded["high_codes"] = pack(_rows_of(codes, salient).reshape(n, -1), self.high_bits)
        if self.count < size:
            encoded["low_codes"] = pack(_rows_of(codes, _other_slots(high)).reshape(n, -1), self.low_bits)
        return encoded

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return self.dequantize(encoded).to(self.shape.dtype)

    def dequantize(self, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 ``[pages, page_size, dim]`` of encoded pages (torch, any device)."""
        scale = encoded["scale"]
        n, size, dim = scale.shape[0], self.shape.page_size, self.shape.dim
        codes = torch.empty(n, size, dim, dtype=torch.float32, device=scale.device)
        high = torch.zeros(n, size, dtype=torch.bool, device=scale.device)
        if self.count:
            salient = encoded["salient"].long()
            high = _high_mask(salient, n, size)
            values = unpack(encoded["high_codes"], self.high_bits, self.count * dim).view(n, self.count, dim).float()
            codes.scatter_(1, salient.unsqueeze(-1).expand(-1, -1, dim), values)
        if self.count < size:
            others = _other_slots(high)
            values = unpack(encoded["low_codes"], self.low_bits, (size - self.count) * dim).view(n, size - self.count, dim).float()
            codes.scatter_(1, others.unsqueeze(-1).expand(-1, -1, dim), values)
        if self.per_channel:
            step = torch.where(high.unsqueeze(-1), scale.float().unsqueeze(1) * self.ratio, scale.float().unsqueeze(1))
            return torch.addcmul(encoded["minimum"].float().unsqueeze(1).expand(n, size, dim), codes, step)
        step = scale.float().repeat_interleave(self.group, dim=-1)
        return torch.addcmul(encoded["minimum"].float().repeat_interleave(self.group, dim=-1), codes, step)

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Gather the pages' fields, decode in float32 and round once, to ``out``'s dtype."""
        index = to_arena_device(pages, out.device)
        encoded = {name: arena.index_select(0, index).view(self._fields[name].dtype) for name, arena in arenas.items()}
        out.index_copy_(0, to_arena_device(rows, out.device), self.dequantize(encoded).to(out.dtype))

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"mixed"``: salient and other tokens' codes dequantized page by page inside the numba
        kernel (:func:`~.mixed_loader.load_mixed`); empty stand-ins for the salient fields where
        ``count`` is 0 and for the low codes where every token is salient. No Triton loader: on
        CUDA a mixed layer is read densely."""
        device = arenas["scale"].device
        empty = torch.zeros(0, 0, dtype=torch.uint8, device=device)
        fields = (
            arenas.get("salient", empty),
            arenas.get("high_codes", empty),
            arenas.get("low_codes", empty),
            arenas["scale"],
            arenas["minimum"],
        )
        return KernelReader(READER, fields, (self.high_bits, self.low_bits, self.count, int(self.per_channel), self.group))


class MixedPageCodec(PageCodec):
    """Keys and values of a page share its salient tokens: the ``count`` slots of highest salience
    (the scores the cache hands at seal time: an eviction policy's keep-scores, or ZipCache's
    normalized attention), or, where none are given (pages sealed by the Engine), of lowest key
    norm (low-norm keys draw the most attention: Devoto et al., 2024, KNorm)."""

    uses_salience = True

    def __init__(self, key: MixedQuantizer, value: MixedQuantizer, name: str) -> None:
        super().__init__(key, value, name)
        self.count = key.count

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor, salience: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if salience is None:
            salience = -keys.float().norm(dim=-1)
        salient = salient_slots(salience.to(keys.device), self.count)
        encoded = {f"key.{n}": t for n, t in self.key.encode_salient(keys, salient).items()}
        encoded.update({f"value.{n}": t for n, t in self.value.encode_salient(values, salient).items()})
        return encoded


def salient_slots(salience: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[n, count]``: each page's ``count`` slots of highest ``salience`` (``[n, page_size]``,
    float; NaN counts lowest), ascending. Ties go to the earlier slot."""
    scores = salience.double().nan_to_num(nan=-torch.inf)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :count].sort(dim=-1).values


def _high_mask(salient: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """bool ``[n, size]``: True at the salient slots."""
    high = torch.zeros(n, size, dtype=torch.bool, device=salient.device)
    return high.scatter_(1, salient, True)


def _other_slots(high: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, size - count]``: each page's slots not salient, ascending."""
    n, size = high.shape
    return torch.sort(high.to(torch.int8), dim=-1, stable=True).indices[:, : size - int(high[0].sum()) if n else 0]


def _rows_of(codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``codes [n, size, dim]`` at ``slots [n, k]``: ``[n, k, dim]``."""
    return codes.gather(1, slots.unsqueeze(-1).expand(-1, -1, codes.shape[-1]))
