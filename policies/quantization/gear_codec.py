"""GEAR's tensor codec (not a policy itself; see :mod:`.gear`): a group quantizer's codes, the
low-rank factors of their residual and a fixed number of exact outliers per page.

Invariants: a page decodes to ``dequantized codes + U V^T`` everywhere but at its outliers, which
decode to their input value rounded to the metadata dtype (fp16, or bf16 for a bf16 model); the
codes quantize the page with its outliers clamped into their group's remaining range, so every
other entry's code error is at most half a step of that narrower range before ``U V^T`` is added.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.codec import Field, TensorCodec, TensorShape
from kvlib.devices import to_arena_device
from kvlib.kernel_readers import KernelReader
from kvlib.policies.quantization import gear_kernels
from kvlib.policies.quantization.uniform import GroupQuantizer, metadata_dtype, write_rows


class GearQuantizer(TensorCodec):
    """GEAR pages ``[n, page_size, dim]``: :class:`~.uniform.GroupQuantizer` codes (``per_channel``
    and ``group`` as there) of the page with ``count`` outliers taken out, plus a rank-``rank``
    approximation of the residual found by ``iterations`` power iterations.

    Fields: the quantizer's ``codes``, ``scale``, ``minimum``; with ``rank``: ``token_factors``
    ``[page_size, rank]`` and ``channel_factors`` ``[dim, rank]``; with ``count``:
    ``outlier_index`` ``[count]`` (token-major element index, int16 where a page has at most
    2**15 elements, else int32) and ``outlier_value`` ``[count]``. ``count`` is capped at the
    entries a page can give up while each quantization group keeps one.
    """

    def __init__(self, shape: TensorShape, bits: int, per_channel: bool, group: int, rank: int, count: int, iterations: int) -> None:
        super().__init__(shape)
        self.quantizer = GroupQuantizer(shape, bits, per_channel=per_channel, group=group)
        elements = shape.page_size * shape.dim
        group_size = self.quantizer.group
        self.rank = rank
        self.count = min(count, elements - elements // group_size)
        self.iterations = iterations
        positions = torch.arange(elements, device=shape.device).view(shape.page_size, shape.dim)
        self._positions = self._grouped(positions.unsqueeze(0)).reshape(-1)
        """Token-major element index of each entry in group order (:meth:`_grouped`)."""
        meta = metadata_dtype(shape.dtype)
        self._fields = dict(self.quantizer.fields)
        if rank:
            self._fields["token_factors"] = Field((shape.page_size, rank), meta)
            self._fields["channel_factors"] = Field((shape.dim, rank), meta)
        if self.count:
            index_dtype = torch.int16 if elements <= 1 << 15 else torch.int32
            self._fields["outlier_index"] = Field((self.count,), index_dtype)
            self._fields["outlier_value"] = Field((self.count,), meta)

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def _grouped(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages [n, page_size, dim]`` as ``[n, groups, group size]``: channels across tokens
        per channel, else runs of ``group`` channels per token (a copy where not a view)."""
        n = pages.shape[0]
        if self.quantizer.per_channel:
            return pages.transpose(1, 2).contiguous()
        return pages.reshape(n, -1, self.quantizer.group)

    def _paged(self, grouped: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_grouped`."""
        n, size, dim = grouped.shape[0], self.shape.page_size, self.shape.dim
        if self.quantizer.per_channel:
            return grouped.transpose(1, 2).contiguous()
        return grouped.reshape(n, size, dim)

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        """On the CPU the outlier filter and the low-rank fit are fused numba kernels
        (:mod:`.gear_kernels`) around the quantizer's own; elsewhere torch (:func:`narrowing_outliers`,
        :func:`power_iteration`)."""
        x = block.float()
        n = x.shape[0]
        meta = metadata_dtype(self.shape.dtype)
        fused = x.device.type == "cpu"
        clipped, index = x, torch.zeros(n, 0, dtype=torch.int64, device=x.device)
        if self.count:
            if fused:
                x = x.contiguous()
                clipped = torch.empty_like(x)
                index = torch.empty(n, self.count, dtype=torch.int64)
                q = self.quantizer
                gear_kernels.narrow_outliers(x.numpy(), q.per_channel, q.group, self.count, clipped.view(n, -1).numpy(), index.numpy())
            else:
                grouped = self._grouped(x)
                low, high, chosen = narrowing_outliers(grouped, self.count)
                clipped = self._paged(torch.maximum(torch.minimum(grouped, high.unsqueeze(-1)), low.unsqueeze(-1)))
                index = self._positions[chosen]
        encoded = self.quantizer.encode(clipped, heads)
        if self.count:
            encoded["outlier_index"] = index.to(self._fields["outlier_index"].dtype)
            encoded["outlier_value"] = x.view(n, -1).gather(1, index).to(meta)
        if self.rank:
            decoded = self.quantizer.dequantize(encoded)
            if fused:
                tokens = torch.empty(n, self.shape.page_size, self.rank)
                channels = torch.empty(n, self.shape.dim, self.rank)
                x = x.contiguous()
                gear_kernels.fit_low_rank(
                    x.numpy(), decoded.view(n, -1).numpy(), index.numpy(), self.iterations, tokens.numpy(), channels.numpy()
                )
            else:
                residual = x - decoded
                residual.view(n, -1).scatter_(1, index, 0.0)
                tokens, channels = power_iteration(residual, self.rank, self.iterations)
            encoded["token_factors"] = tokens.to(meta)
            encoded["channel_factors"] = channels.to(meta)
        return encoded

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return self.dequantize(encoded).to(self.shape.dtype)

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Decode in float32 and round once, to ``out``'s dtype (a float32 buffer gets what the page
        loader computes). On the CPU the quantizer's fused kernel decodes the codes (in place in a
        float32 ``out``) and :func:`~.gear_kernels.add_corrections` adds ``U V^T`` and the outliers."""
        if out.device.type != "cpu":
            index = to_arena_device(pages, out.device)
            encoded = {name: arena.index_select(0, index).view(self._fields[name].dtype) for name, arena in arenas.items()}
            out.index_copy_(0, to_arena_device(rows, out.device), self.dequantize(encoded).to(out.dtype))
            return
        m = pages.numel()
        codes = {name: arenas[name] for name in self.quantizer.fields}
        if out.dtype == torch.float32:
            self.quantizer.decode_into(codes, pages, heads, out, rows)
            self._correct(arenas, pages, out, rows)
            return
        decoded = torch.empty(m, self.shape.page_size, self.shape.dim, dtype=torch.float32)
        every = torch.arange(m)
        self.quantizer.decode_into(codes, pages, heads, decoded, every)
        self._correct(arenas, pages, decoded, every)
        write_rows(out, rows, decoded)

    def _correct(self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Add ``U V^T`` of arena rows ``pages`` to float32 CPU ``out[rows]`` (the codes decoded) and write the outliers over."""
        m = pages.numel()

        def gathered(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
            if name not in arenas:
                return np.zeros((m, *shape), dtype=np.float32 if dtype.is_floating_point else np.int64)
            taken = arenas[name].index_select(0, pages).view(self._fields[name].dtype)
            return taken.to(dtype).numpy()

        size, dim = self.shape.page_size, self.shape.dim
        tokens = gathered("token_factors", (size, 0), torch.float32)
        channels = gathered("channel_factors", (dim, 0), torch.float32)
        index = gathered("outlier_index", (0,), torch.int64)
        value = gathered("outlier_value", (0,), torch.float32)
        gear_kernels.add_corrections(out.view(out.shape[0], -1).numpy(), rows.numpy(), tokens, channels, index, value)

    def dequantize(self, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 ``[pages, page_size, dim]``: codes + ``U V^T``, outliers written over (the fused
        kernels on the CPU, torch elsewhere)."""
        if encoded["codes"].device.type == "cpu":
            n = encoded["codes"].shape[0]
            out = self.quantizer.dequantize(encoded)
            every = torch.arange(n)
            self._correct(encoded, every, out, every)
            return out
        values = self.quantizer.dequantize(encoded)
        if self.rank:
            values = values.baddbmm(encoded["token_factors"].float(), encoded["channel_factors"].float().transpose(1, 2))
        if self.count:
            values.view(values.shape[0], -1).scatter_(1, encoded["outlier_index"].long(), encoded["outlier_value"].float())
        return values

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"gear"``: codes, ``U V^T`` and outliers decoded page by page inside the numba kernel
        (:func:`~.page_readers.load_gear`); empty stand-ins for the factors and outliers a codec
        without them has. No Triton loader: on CUDA a GEAR layer is read densely."""
        q = self.quantizer
        device = arenas["codes"].device
        factors = torch.zeros(0, 0, dtype=q.meta, device=device)
        fields = (
            arenas["codes"],
            arenas["scale"],
            arenas["minimum"],
            arenas["token_factors"] if self.rank else factors,
            arenas["channel_factors"] if self.rank else factors,
            arenas["outlier_index"] if self.count else torch.zeros(0, 0, dtype=torch.int16, device=device),
            arenas["outlier_value"] if self.count else factors,
        )
        return KernelReader("gear", fields, (q.bits, int(q.per_channel), q.group, self.rank, self.count))


def narrowing_outliers(grouped: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedily take ``count`` entries out of each page of ``grouped [n, groups, size]`` (float32),
    each time the group's lowest or highest remaining entry whose removal shrinks its group's
    squared range the most (a group's quantization error grows with its range squared); a group
    keeps at least one entry (``count`` must leave one per group). Returns ``(low, high, chosen)``:
    each group's remaining range ``[n, groups]`` and the taken entries' indices into the flattened
    ``groups * size`` ``[n, count]``, distinct per page."""
    n, groups, size = grouped.shape
    ordered, order = grouped.sort(-1)
    lo = torch.zeros(n, groups, dtype=torch.int64, device=grouped.device)
    hi = torch.full_like(lo, size - 1)
    chosen = torch.empty(n, count, dtype=torch.int64, device=grouped.device)
    pages = torch.arange(n, device=grouped.device)

    def at(rank: torch.Tensor) -> torch.Tensor:
        return ordered.gather(-1, rank.clamp(0, size - 1).unsqueeze(-1)).squeeze(-1)

    for step in range(count):
        bottom, top = at(lo), at(hi)
        span = (top - bottom).square()
        gains = torch.stack([span - (top - at(lo + 1)).square(), span - (at(hi - 1) - bottom).square()], -1)
        gains = gains.masked_fill((hi <= lo).unsqueeze(-1), float("-inf")).view(n, -1)
        best = gains.argmax(-1)
        group, upper = best // 2, best % 2
        rank = torch.where(upper == 1, hi[pages, group], lo[pages, group])
        chosen[:, step] = group * size + order[pages, group, rank]
        hi[pages, group] -= upper
        lo[pages, group] += 1 - upper
    return at(lo), at(hi), chosen


def power_iteration(residual: torch.Tensor, rank: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U [n, rows, rank], V [n, cols, rank])`` with ``U V^T`` approximating each float32
    ``residual [n, rows, cols]`` at rank ``rank``: subspace iteration from the ``rank`` rows of
    largest norm, ``U`` orthonormal columns, ``V = residual^T U`` (so ``U V^T`` is the projection
    of the residual on ``U``'s span)."""
    cols = residual.shape[2]
    start = residual.norm(dim=-1).topk(rank, dim=-1).indices
    channels = residual.gather(1, start.unsqueeze(-1).expand(-1, -1, cols)).transpose(1, 2)
    for _ in range(iterations):
        tokens = torch.linalg.qr(residual @ channels).Q
        channels = residual.transpose(1, 2) @ tokens
    return tokens, channels
