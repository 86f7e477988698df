"""QAQ: per-token bits from separate key and value rules, outliers kept exact, within a page budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlib.codec import Field, PageCodec, TensorCodec, TensorShape
from kvlib.devices import to_arena_device
from kvlib.kernel_readers import KernelReader
from kvlib.kernels.packing import PACKABLE_BITS, pack, unpack
from kvlib.policies.quantization.uniform import grid, metadata_dtype
from kvlib.policy import Eviction, LayerView, Quantization
from kvlib.registry import register


def allocate_bits(weight: torch.Tensor, capacity: int, widths: tuple[int, ...]) -> torch.Tensor:
    """QAQ's bits per token under a page budget: int64 ``[n, size]`` from ``weight`` float
    ``[n, size]`` (>= 0: a token's range for keys, range times attention for values).

    QAQ gives token ``i`` the bits ``log2(W_i / c + 1)`` rounded up (``c`` twice the error it
    tolerates, one value for the page), clamped to ``widths`` (ascending) and rounded up to the
    next of them. Here the page holds at most ``capacity`` token-bits, so ``c`` is the smallest for
    which the tokens' bits sum to at most ``capacity`` (``capacity >= size * widths[0]``: at the
    largest ``c`` every token takes ``widths[0]``). Higher weight never gets fewer bits."""
    n, size = weight.shape
    w = torch.tensor(widths, dtype=torch.float64, device=weight.device)
    thresholds = weight.double().clamp(min=0).nan_to_num(0.0, 0.0, 0.0).unsqueeze(-1) / (2.0**w - 1)  # [n, size, widths]

    def bits_at(c: torch.Tensor) -> torch.Tensor:  # c [n, k] -> widths' index [n, k, size]
        too_few = (c.unsqueeze(-1).unsqueeze(-1) < thresholds.unsqueeze(1)).sum(-1)
        return too_few.clamp(max=len(widths) - 1)

    candidates = torch.cat([thresholds.reshape(n, -1), torch.full((n, 1), math.inf, dtype=torch.float64, device=weight.device)], 1)
    totals = w[bits_at(candidates)].sum(-1)
    best = torch.where(totals <= capacity, candidates, math.inf).amin(-1, keepdim=True)
    return w[bits_at(best)].squeeze(1).long()


class TokenAdaptiveQuantizer(TensorCodec):
    """A page ``[page_size, dim]`` of keys or values as QAQ stores it: each token quantized on its
    own (asymmetric min/max over its entries but its outliers) at its own bits, chosen by
    :func:`allocate_bits` within ``capacity`` token-bits, and its ``count`` lowest and ``count``
    highest entries kept exact.

    Fields: ``codes`` ``[capacity * dim / 8]`` (tokens in slot order, each ``dim * bits / 8``
    bytes of :func:`~kvlib.kernels.packing.pack`'s layout at its bits; the rest zero), ``bits``
    ``[page_size]`` (uint8), ``scale`` and ``minimum`` ``[page_size]`` (metadata dtype), and with
    ``count``: ``outlier_index`` ``[page_size, 2 * count]`` (the entries' channels) and
    ``outlier_value`` (their values in the metadata dtype). Invariants: every entry but the
    outliers decodes within half its token's step of its input (before rounding to the compute
    dtype), the outliers to their input in the metadata dtype; ``dim`` is a multiple of 8, so
    every token's codes fill whole bytes.
    """

    def __init__(self, shape: TensorShape, average_bits: float, widths: tuple[int, ...], count: int) -> None:
        super().__init__(shape)
        self.widths, self.count = widths, count
        self.capacity = math.floor(average_bits * shape.page_size)
        """Token-bits a page holds (each token's codes take ``dim * bits`` bits)."""
        self.meta = metadata_dtype(shape.dtype)
        size, dim = shape.page_size, shape.dim
        self._fields = {
            "codes": Field((self.capacity * dim // 8,), torch.uint8),
            "bits": Field((size,), torch.uint8, metadata=True),
            "scale": Field((size,), self.meta, metadata=True),
            "minimum": Field((size,), self.meta, metadata=True),
        }
        if count:
            self._fields["outlier_index"] = Field((size, 2 * count), torch.uint8 if dim <= 256 else torch.int16)
            self._fields["outlier_value"] = Field((size, 2 * count), self.meta)

    @property
    def fields(self) -> dict[str, Field]:
        return self._fields

    def ranges(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(low, high, outliers)`` of float32 pages ``[n, size, dim]``: each token's lowest and
        highest entry but its outliers, and the outliers' channels int64 ``[n, size, 2 * count]``
        (its ``count`` lowest, then its ``count`` highest entries)."""
        ordered, order = block.sort(-1)
        dim = block.shape[-1]
        outliers = torch.cat([order[..., : self.count], order[..., dim - self.count :]], -1)
        return ordered[..., self.count], ordered[..., dim - 1 - self.count], outliers

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        """Bits by the token's range alone (QAQ's key rule; the page codec hands values their attention)."""
        return self.encode_weighted(block, None)

    def encode_weighted(self, block: torch.Tensor, attention: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Encode pages ``block [n, size, dim]``; a token's bits grow with its range times
        ``attention`` float ``[n, size]`` (>= 0; None: its range alone)."""
        x = block.float()
        n, size, dim = x.shape
        low, high, outliers = self.ranges(x)
        weight = high - low if attention is None else (high - low) * attention.to(x.device).float()
        bits = allocate_bits(weight, self.capacity, self.widths).to(x.device)
        scales = torch.stack([grid(low, high, w, self.meta)[0] for w in self.widths], -1)
        minimum = grid(low, high, self.widths[0], self.meta)[1]
        index = torch.searchsorted(torch.tensor(self.widths, device=x.device), bits)
        scale = scales.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        step = scale.float().unsqueeze(-1)
        inverse = torch.where(step > 0, 1.0 / step, 0.0)
        clipped = torch.minimum(torch.maximum(x, low.unsqueeze(-1)), high.unsqueeze(-1))
        levels = (2.0**bits - 1).unsqueeze(-1).float()
        codes = ((clipped - minimum.float().unsqueeze(-1)) * inverse).round_().clamp_(min=0).minimum(levels).to(torch.uint8)
        encoded = {"codes": self._pack(codes, bits), "bits": bits.to(torch.uint8), "scale": scale, "minimum": minimum}
        if self.count:
            encoded["outlier_index"] = outliers.to(self._fields["outlier_index"].dtype)
            encoded["outlier_value"] = x.gather(-1, outliers).to(self.meta)
        return encoded

    def _byte_index(self, bits: torch.Tensor, width: int) -> torch.Tensor:
        """int64 ``[n, size, dim * width / 8]``: where each token's codes would lie at ``width``
        bits, its codes starting after the earlier tokens' (at their own bits)."""
        dim = self.shape.dim
        offsets = (bits * dim // 8).cumsum(-1) - bits * dim // 8
        return offsets.unsqueeze(-1) + torch.arange(dim * width // 8, device=bits.device)

    def _pack(self, codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        room = self._fields["codes"].shape[0]
        out = torch.zeros(n, room + 1, dtype=torch.uint8, device=codes.device)  # the last column takes other widths' writes
        for width in self.widths:
            packed = pack(codes.minimum(torch.tensor((1 << width) - 1, dtype=torch.uint8, device=codes.device)), width)
            index = torch.where((bits == width).unsqueeze(-1), self._byte_index(bits, width), room)
            out.scatter_(1, index.reshape(n, -1), packed.reshape(n, -1))
        return out[:, :room]

    def dequantize(self, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 ``[pages, page_size, dim]`` of encoded pages."""
        packed, bits = encoded["codes"], encoded["bits"].long()
        n, dim = packed.shape[0], self.shape.dim
        room = packed.shape[1]
        codes = torch.zeros(n, self.shape.page_size, dim, device=packed.device)
        for width in self.widths:
            index = self._byte_index(bits, width).clamp(max=room - 1)
            unpacked = unpack(packed.gather(1, index.reshape(n, -1)).view(*index.shape), width, dim).float()
            codes = torch.where((bits == width).unsqueeze(-1), unpacked, codes)
        values = torch.addcmul(encoded["minimum"].float().unsqueeze(-1), codes, encoded["scale"].float().unsqueeze(-1))
        if self.count:
            values.scatter_(-1, encoded["outlier_index"].long(), encoded["outlier_value"].float())
        return values

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return self.dequantize(encoded).to(self.shape.dtype)

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"qaq"``: each token decoded at its own bits, outliers written over, page by page inside
        the numba kernel (:func:`~.page_readers.load_qaq`); empty stand-ins for the outliers
        where ``count`` is 0. No Triton loader: on CUDA a QAQ layer is read densely."""
        device = arenas["codes"].device
        index = arenas["outlier_index"] if self.count else torch.zeros(0, 0, dtype=torch.uint8, device=device)
        value = arenas["outlier_value"] if self.count else torch.zeros(0, 0, dtype=self.meta, device=device)
        fields = (arenas["codes"], arenas["bits"], arenas["scale"], arenas["minimum"], index, value)
        return KernelReader("qaq", fields, (self.count,))

    def decode_into(
        self, arenas: dict[str, torch.Tensor], pages: torch.Tensor, heads: torch.Tensor, out: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Gather the pages' fields, decode in float32 and round once, to ``out``'s dtype."""
        index = to_arena_device(pages, out.device)
        encoded = {name: arena.index_select(0, index).view(self._fields[name].dtype) for name, arena in arenas.items()}
        out.index_copy_(0, to_arena_device(rows, out.device), self.dequantize(encoded).to(out.dtype))


def attention_weights(salience: torch.Tensor) -> torch.Tensor:
    """float64 ``[n, size]`` >= 0 standing for the attention each token of a page received, from
    seal-time scores ``[n, size]``: QAQ's peak attention as it is; an eviction policy's keep-scores
    (any scale) with ``+inf`` (kept whatever the budget) as the page's highest finite score, ``-inf``
    and NaN as its lowest, then shifted so the lowest is 0 where any is negative."""
    scores = salience.double()
    finite = scores.isfinite()
    high = torch.where(finite, scores, -math.inf).amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    low = torch.where(finite, scores, math.inf).amin(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    scores = torch.where(scores == math.inf, high, torch.where(finite, scores, low))
    return torch.where(low < 0, scores - low, scores)


class AttentionPagedCodec(PageCodec):
    """QAQ's two rules on one page: keys by their range, values by their range times the attention
    each token received (the salience the cache hands at seal time, through
    :func:`attention_weights`). Pages sealed without it (the Engine's) give values their range alone."""

    uses_salience = True

    def encode(
        self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor, salience: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        attention = None if salience is None else attention_weights(salience)
        encoded = {f"key.{n}": t for n, t in self.key.encode_weighted(keys, None).items()}
        encoded.update({f"value.{n}": t for n, t in self.value.encode_weighted(values, attention).items()})
        return encoded


@dataclass
class PeakRecentAttention(Eviction):
    """QAQ's attention-aware salience: the largest attention a token received from the layer's last
    ``window`` queries (across calls), over the query heads of its KV group. A scorer for the
    ``qaq`` codec, not a registered policy: it never evicts (the cache runs it with no budget)."""

    window: int = 5
    needs: ClassVar[frozenset[str]] = frozenset({"recent_queries"})
    order_free: ClassVar[bool] = True

    def observed_queries(self) -> int:
        return self.window

    def score(self, view: LayerView) -> torch.Tensor:
        batch, kv_heads, slots = view.valid.shape
        attention = view.recent_attention.float().view(batch, kv_heads, -1, slots)
        return attention.amax(2).masked_fill(~view.valid, 0.0)


@register("qaq")
@dataclass
class QAQ(Quantization):
    """QAQ (Dong, Cheng, Qin and Wang, 2024, "QAQ: Quality Adaptive Quantization for LLM KV
    Cache", arXiv:2403.04643): keys and values are quantized by separate rules, each token at
    the bits its own error tolerance asks, with outliers kept exact.

    Each token of a page is quantized on its own (QAQ's per-head level: one min/max grid per token
    and KV head). QAQ's bits for token ``i`` are ``log2(R_i / (2 e_i) + 1)``, ``R_i`` its range:
    for keys ``e_i`` is one tolerance for every token (its bound on the attention scores' error
    through the query norm), so bits follow the range; for values ``e_i`` falls as the attention
    ``a_i`` the token receives grows, so bits follow ``R_i a_i``. ``a_i`` is QAQ's attention window:
    the largest attention from the layer's last ``window`` queries (or, in a spec with an
    eviction policy, its keep-scores). QAQ fixes the tolerance and lets sizes vary; pages here
    have fixed fields, so each page holds ``floor(bits * page_size)`` token-bits (``key_bits`` and
    ``value_bits`` average bits per element) and the tolerance is the tightest whose bits fit
    (:func:`allocate_bits`); widths are ``min_bits`` to ``max_bits`` among 1, 2, 3, 4, 8. QAQ's
    outliers are each token's ``ceil(outliers / 2 * dim)`` lowest and as many highest entries (its
    ``outliers_ratio`` split between the two ends): kept exact in the page's fields (channel and
    value), left out of the token's range. QAQ's other attention-window rule, the newest
    ``window - 1`` tokens at the maximum bits, is left to the open page (kept in the compute
    dtype until full). Sealed pages are read where they lie by the numba kernel (each token
    decoded at its bits inside it: :func:`~kvlib.policies.quantization.page_readers.load_qaq`);
    on CUDA, densely (no Triton loader).

    Defaults: QAQ's grid (``outliers_ratio=0.01``, ``last_n_attentions=5``, bits 1 to 4) with 3
    average bits for keys and 2 for values (QAQ: keys are the more sensitive).

    Args:
        key_bits: average code bits per key element of a page, in ``[min_bits, max_bits]``.
        value_bits: average code bits per value element of a page, in ``[min_bits, max_bits]``.
        min_bits: fewest bits of a token (1, 2, 3, 4 or 8).
        max_bits: most bits of a token (1, 2, 3, 4 or 8; at least ``min_bits``).
        outliers: fraction of each token's entries kept exact, half its lowest, half its highest, in [0, 0.5).
        window: recent queries whose peak attention weighs a value token (>= 1).
    """

    key_bits: float = 3.0
    value_bits: float = 2.0
    min_bits: int = 1
    max_bits: int = 4
    outliers: float = 0.01
    window: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("min_bits", "max_bits"):
            if getattr(self, name) not in PACKABLE_BITS:
                raise ValueError(f"{name} must be one of {PACKABLE_BITS}, got {getattr(self, name)!r}")
        if self.min_bits > self.max_bits:
            raise ValueError(f"min_bits ({self.min_bits}) must not exceed max_bits ({self.max_bits})")
        for name in ("key_bits", "value_bits"):
            if not self.min_bits <= getattr(self, name) <= self.max_bits:
                raise ValueError(
                    f"{name} must lie in [min_bits, max_bits] = [{self.min_bits}, {self.max_bits}], got {getattr(self, name)!r}"
                )
        if not 0 <= self.outliers < 0.5:
            raise ValueError(f"outliers must be a fraction in [0, 0.5), got {self.outliers!r}")
        if self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    def outliers_per_side(self, dim: int) -> int:
        """Entries kept exact at each end of a token of ``dim`` channels."""
        return math.ceil(self.outliers / 2 * dim)

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        for key, value in shapes:
            for shape in (key, value):
                if shape.dim % 8:
                    raise ValueError(
                        f"qaq needs head dims that are multiples of 8 (whole bytes per token), got {shape.dim} (layer {shape.layer_idx})"
                    )
                if 2 * self.outliers_per_side(shape.dim) >= shape.dim:
                    raise ValueError(f"outliers={self.outliers} keeps every channel of a {shape.dim}-channel head exact")

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        widths = tuple(w for w in PACKABLE_BITS if self.min_bits <= w <= self.max_bits)
        return [
            AttentionPagedCodec(
                TokenAdaptiveQuantizer(key, self.key_bits, widths, self.outliers_per_side(key.dim)),
                TokenAdaptiveQuantizer(value, self.value_bits, widths, self.outliers_per_side(value.dim)),
                self.spec(),
            )
            for key, value in shapes
        ]

    def salience_scorer(self) -> Eviction:
        return PeakRecentAttention(window=self.window)
