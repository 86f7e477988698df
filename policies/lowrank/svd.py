"""SVD: keys (and values) stored as coefficients in a per-layer, per-head basis fitted at prefill."""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.codec import FitSample, IdentityCodec, PageCodec, TensorCodec, TensorShape
from kvlib.policies.lowrank.basis import BasisCodec, enough_rows, fit_basis, head_rows
from kvlib.policy import LowRank
from kvlib.registry import register


class FittedBasisCodec(BasisCodec):
    """A :class:`BasisCodec` that fits its basis on its layer's first call that holds at least
    ``dim`` real tokens per head (all the layer's stored tokens then)."""

    learns = True

    def __init__(self, shape: TensorShape, rank: int, energy: float) -> None:
        super().__init__(shape)
        self.fit_rank = rank
        self.energy = energy

    def observe(self, sample: FitSample, part: str) -> None:
        tensor = sample.keys if part == "keys" else sample.values
        if not enough_rows(sample.valid, self.shape.dim):
            return
        basis, _ = fit_basis(head_rows(tensor, sample.valid), self.fit_rank, self.energy)
        self.set_basis(basis)


@register("svd")
@dataclass
class SVD(LowRank):
    """Per-layer, per-head low-rank KV (as in Eigen Attention, Saxena et al., 2024, and Palu,
    Chang et al., 2024, here on the stored post-RoPE keys): each head's basis is the top right
    singular vectors of the layer's prefill keys (and values), and sealed pages store each
    token's coefficients in it. The fit runs after the layer's first attention call that holds at
    least ``head_dim`` real tokens per head (the prompt, usually); full pages wait open until then.

    Args:
        rank: basis size per head; 0 means choose it by ``energy``.
        energy: with ``rank=0``, the smallest rank keeping this fraction of the squared
            singular values in every head of the layer, in (0, 1].
        values: also store values in a basis (else values stay in the compute dtype).
    """

    rank: int = 0
    energy: float = 0.95
    values: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rank_energy(self.rank, self.energy)

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        codecs = []
        for key, value in shapes:
            value_codec: TensorCodec = FittedBasisCodec(value, self.rank, self.energy) if self.values else IdentityCodec(value)
            codecs.append(PageCodec(FittedBasisCodec(key, self.rank, self.energy), value_codec, self.spec()))
        return codecs


def check_rank_energy(rank: int, energy: float) -> None:
    if rank < 0:
        raise ValueError(f"rank must be an int >= 0 (0: choose by energy), got {rank}")
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
