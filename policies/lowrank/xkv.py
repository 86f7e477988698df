"""xKV: adjacent layers share one low-rank basis per head, fitted on all their prefill KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.codec import FitSample, IdentityCodec, PageCodec, TensorCodec, TensorShape
from kvlib.policies.lowrank.basis import BasisCodec, enough_rows, fit_basis, head_rows
from kvlib.policies.lowrank.svd import check_rank_energy
from kvlib.policy import LowRank
from kvlib.registry import register


class LayerGroup:
    """The layers sharing one basis per head, for one part (keys or values): collects each
    layer's prefill rows and, once every layer has given them, fits and hands out the basis."""

    def __init__(self, layers: list[int], rank: int, energy: float) -> None:
        self.layers = layers
        self.rank = rank
        self.energy = energy
        self.rows: dict[int, torch.Tensor] = {}
        self.members: list[BasisCodec] = []

    def add(self, layer: int, rows: torch.Tensor) -> None:
        self.rows[layer] = rows
        if len(self.rows) == len(self.layers):
            basis, _ = fit_basis(torch.cat([self.rows[i] for i in self.layers], dim=1), self.rank, self.energy)
            for member in self.members:
                member.set_basis(basis)
            self.rows.clear()


class SharedBasisCodec(BasisCodec):
    """One layer's view of a :class:`LayerGroup`'s shared basis (its state bytes are counted
    once, by the group's first layer)."""

    learns = True

    def __init__(self, shape: TensorShape, group: LayerGroup) -> None:
        super().__init__(shape)
        self.group = group
        group.members.append(self)

    def observe(self, sample: FitSample, part: str) -> None:
        tensor = sample.keys if part == "keys" else sample.values
        if enough_rows(sample.valid, self.shape.dim):
            self.group.add(self.shape.layer_idx, head_rows(tensor, sample.valid))

    def state_bytes(self) -> int:
        return super().state_bytes() if self.shape.layer_idx == self.group.layers[0] else 0


@register("xkv")
@dataclass
class XKV(LowRank):
    """Cross-layer low-rank KV (after xKV, Chang et al., 2025, "xKV: Cross-Layer SVD for KV-Cache
    Compression"): the dominant singular vectors of adjacent layers' KV are well aligned, so
    groups of ``layers`` adjacent layers share one basis per head, fitted by SVD on all their
    prefill tokens stacked; each layer stores its tokens' coefficients in it. A layer contributes
    its first call holding at least ``head_dim`` real tokens per head; a group's pages wait open
    until all its layers have.

    xKV proper also shares the token-side factor across the group (one coefficient set for all
    its layers); pages here are per layer, so each layer keeps its own coefficients and the
    sharing saves basis state and fitting, not per-token bytes.

    Args:
        layers: adjacent layers per group (the last group may be smaller).
        rank: shared basis size per head; 0 means choose it by ``energy``.
        energy: with ``rank=0``, the fraction of squared singular values kept, in (0, 1].
        values: also store values in a shared basis.
    """

    layers: int = 2
    rank: int = 0
    energy: float = 0.95
    values: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layers < 1:
            raise ValueError(f"layers must be an int >= 1, got {self.layers}")
        check_rank_energy(self.rank, self.energy)

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        count = len(shapes)
        codecs = []
        for first in range(0, count, self.layers):
            members = list(range(first, min(first + self.layers, count)))
            keys = LayerGroup(members, self.rank, self.energy)
            values = LayerGroup(members, self.rank, self.energy) if self.values else None
            for layer in members:
                key_shape, value_shape = shapes[layer]
                value_codec: TensorCodec = SharedBasisCodec(value_shape, values) if values else IdentityCodec(value_shape)
                codecs.append(PageCodec(SharedBasisCodec(key_shape, keys), value_codec, self.spec()))
        return codecs
