"""MiniCache: adjacent deep layers share each token's KV direction; each keeps its own magnitude."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.codec import Field, PageCodec, TensorCodec, TensorShape
from kvlib.policy import LowRank
from kvlib.registry import register


def merge_pages(
    shallow: torch.Tensor, deep: torch.Tensor, t: float, retained: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge pages of two layers ``[n, page_size, dim]`` (same tokens).

    Each token's directions ``u = x / |x|`` are interpolated on the sphere (SLERP, weight ``t`` on
    the deeper layer); the ``retained`` tokens of each page whose directions differ most (largest
    angle) stay unmerged: the shared direction is the shallow layer's own and the deep token is
    kept whole. Returns ``(direction, shallow magnitude, deep magnitude, kept deep tokens
    [n, retained, dim], their slots [n, retained])``; float32.
    """
    a, b = shallow.float(), deep.float()
    norm_a, norm_b = a.norm(dim=-1), b.norm(dim=-1)
    unit_a = a / norm_a.clamp_min(1e-30).unsqueeze(-1)
    unit_b = b / norm_b.clamp_min(1e-30).unsqueeze(-1)
    angle = (unit_a * unit_b).sum(-1).clamp(-1.0, 1.0).acos()
    sine = angle.sin()
    straight = sine < 1e-6  # (anti)parallel: interpolate linearly, then renormalise
    safe = torch.where(straight, 1.0, sine)
    weight_a = torch.where(straight, 1.0 - t, ((1.0 - t) * angle).sin() / safe).unsqueeze(-1)
    weight_b = torch.where(straight, t, (t * angle).sin() / safe).unsqueeze(-1)
    direction = weight_a * unit_a + weight_b * unit_b
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    slots = angle.topk(retained, dim=-1).indices if retained else angle.new_zeros(a.shape[0], 0, dtype=torch.long)
    index = slots.unsqueeze(-1).expand(-1, -1, a.shape[-1])
    direction.scatter_(1, index, unit_a.gather(1, index))
    return direction, norm_a, norm_b, b.gather(1, index), slots


class SharedDirections(TensorCodec):
    """The shallow layer's side: each token's (merged) unit direction and its own magnitude."""

    @property
    def fields(self) -> dict[str, Field]:
        size, dim, dtype = self.shape.page_size, self.shape.dim, self.shape.dtype
        return {"direction": Field((size, dim), dtype), "magnitude": Field((size,), dtype)}

    @property
    def ready(self) -> bool:
        return False  # sealed only together with the deeper layer's page

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        raise RuntimeError("MiniCache pages are sealed in pairs (PagedStore.seal on the deeper layer)")

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        return (encoded["direction"].float() * encoded["magnitude"].float().unsqueeze(-1)).to(self.shape.dtype)


class DeepRemainder(TensorCodec):
    """The deep layer's side: each token's magnitude, and the ``retained`` tokens kept whole."""

    def __init__(self, shape: TensorShape, retained: int) -> None:
        super().__init__(shape)
        self.retained = retained

    @property
    def fields(self) -> dict[str, Field]:
        size, dim, dtype = self.shape.page_size, self.shape.dim, self.shape.dtype
        return {
            "magnitude": Field((size,), dtype),
            "kept": Field((self.retained, dim), dtype),
            "slots": Field((self.retained,), torch.int16, metadata=True),
        }

    @property
    def ready(self) -> bool:
        return False

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        raise RuntimeError("MiniCache pages are sealed in pairs (PagedStore.seal on the deeper layer)")

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a MiniCache deep page decodes with its partner (PartneredPages)")

    def decode_with_partner(self, own: dict[str, torch.Tensor], partner: dict[str, torch.Tensor]) -> torch.Tensor:
        """``magnitude x partner direction``, with the kept tokens put back whole."""
        out = partner["direction"].float() * own["magnitude"].float().unsqueeze(-1)
        index = own["slots"].long().unsqueeze(-1).expand(-1, -1, out.shape[-1])
        return out.scatter_(1, index, own["kept"].float()).to(self.shape.dtype)


class ShallowCodec(PageCodec):
    """The shallow layer of a MiniCache pair."""


class DeepCodec(PageCodec):
    """The deep layer of a MiniCache pair: merges its pages with layer ``partner_layer``'s."""

    def __init__(self, key: DeepRemainder, value: DeepRemainder, name: str, partner_layer: int, t: float) -> None:
        super().__init__(key, value, name)
        self.partner_layer = partner_layer
        self.t = t

    def merge(
        self, shallow: tuple[torch.Tensor, torch.Tensor], deep: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Fields of the shallow pages and of the deep pages for pages ``(keys, values)`` of both layers."""
        shallow_fields, deep_fields = {}, {}
        for part, a, b in (("key", shallow[0], deep[0]), ("value", shallow[1], deep[1])):
            direction, norm_a, norm_b, kept, slots = merge_pages(a, b, self.t, self.key.retained)
            shallow_fields |= {f"{part}.direction": direction, f"{part}.magnitude": norm_a}
            deep_fields |= {f"{part}.magnitude": norm_b, f"{part}.kept": kept, f"{part}.slots": slots.to(torch.int16)}
        return shallow_fields, deep_fields

    def decode_with_partner(
        self, own: dict[str, torch.Tensor], partner: dict[str, torch.Tensor], heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for part, codec in (("key", self.key), ("value", self.value)):
            prefix = f"{part}."
            mine = {n[len(prefix) :]: t for n, t in own.items() if n.startswith(prefix)}
            theirs = {n[len(prefix) :]: t for n, t in partner.items() if n.startswith(prefix)}
            parts.append(codec.decode_with_partner(mine, theirs))
        return parts[0], parts[1]


@register("minicache")
@dataclass
class MiniCache(LowRank):
    """MiniCache (Liu et al., 2024, "MiniCache: KV Cache Compression in Depth Dimension"): from the
    middle of the network on, adjacent layers' KV states point in nearly the same directions, so
    each pair of layers ``(l, l + 1)`` stores one direction per token (SLERP of the two, weight
    ``t`` on the deeper layer) plus each layer's magnitude; in each page, the ``retain`` share of
    tokens whose directions differ most stay unmerged (both layers exact).

    Pages are merged when both layers' pages are full and hold the same tokens (same positions);
    pages that differ (a head whose two layers kept different tokens after eviction) stay
    uncompressed. Layers before ``start`` (and an unpaired last layer) are stored as they are.

    Args:
        start: fraction of the depth where merging starts, in [0, 1) (MiniCache: the middle).
        t: SLERP weight of the deeper layer's direction, in [0, 1].
        retain: share of each page's tokens kept unmerged, in [0, 1).
    """

    start: float = 0.5
    t: float = 0.6
    retain: float = 0.125

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.start < 1.0:
            raise ValueError(f"start must be in [0, 1), got {self.start}")
        if not 0.0 <= self.t <= 1.0:
            raise ValueError(f"t must be in [0, 1], got {self.t}")
        if not 0.0 <= self.retain < 1.0:
            raise ValueError(f"retain must be in [0, 1), got {self.retain}")

    def pairs(self, num_layers: int) -> list[tuple[int, int]]:
        """The merged layer pairs of a model with ``num_layers`` layers."""
        first = math.ceil(self.start * num_layers)
        return [(layer, layer + 1) for layer in range(first, num_layers - 1, 2)]

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        if not self.pairs(len(shapes)):
            raise ValueError(
                f"minicache(start={self.start}) pairs layers from {math.ceil(self.start * len(shapes))} on, but the"
                f" model has {len(shapes)} layers: no pair to merge; lower start"
            )

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec | None]:
        codecs: list[PageCodec | None] = [None] * len(shapes)
        for shallow, deep in self.pairs(len(shapes)):
            key, value = shapes[shallow]
            codecs[shallow] = ShallowCodec(SharedDirections(key), SharedDirections(value), self.spec())
            key, value = shapes[deep]
            kept = round(self.retain * key.page_size)
            codecs[deep] = DeepCodec(DeepRemainder(key, kept), DeepRemainder(value, kept), self.spec(), shallow, self.t)
        return codecs
