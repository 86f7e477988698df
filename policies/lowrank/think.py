"""ThinK: query-driven pruning of key channels; only the kept channels are stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.codec import Field, FitSample, IdentityCodec, PageCodec, TensorCodec, TensorShape
from kvlib.policy import LowRank
from kvlib.registry import register


class ChannelPruner(TensorCodec):
    """Keeps ``kept`` key channels per head (chosen at the layer's first call); pruned channels
    read back as zero, so ``q . k`` over the kept channels is exact for them."""

    learns = True

    def __init__(self, shape: TensorShape, keep: float, window: int) -> None:
        super().__init__(shape)
        self.kept = max(1, round(keep * shape.dim))
        self.window = window
        self.channels: torch.Tensor | None = None
        """int64 ``[kv_heads, kept]``: each head's kept channels, ascending."""

    @property
    def ready(self) -> bool:
        return self.channels is not None

    @property
    def fields(self) -> dict[str, Field]:
        return {"channels": Field((self.shape.page_size, self.kept), self.shape.dtype)}

    def observe(self, sample: FitSample, part: str) -> None:
        """Score channel ``c`` of a head by ``||Q[:, c]|| * ||K[:, c]||`` (ThinK's magnitude
        criterion): Q the last ``window`` real queries of the call (all query heads of the KV
        group), K the stored real keys; keep the top ``kept``."""
        queries = sample.queries.float()
        batch, query_heads, length, dim = queries.shape
        heads = self.shape.kv_heads
        real = sample.query_valid.to(queries.device)
        recent = real & (real.flip(-1).cumsum(-1).flip(-1) <= self.window)
        queries = queries * recent.view(batch, 1, length, 1)
        query_norm = queries.view(batch, heads, query_heads // heads, length, dim).square().sum((0, 2, 3))
        keys = sample.keys.float() * sample.valid.unsqueeze(-1)
        key_norm = keys.square().sum((0, 2))
        score = (query_norm * key_norm).sqrt()
        self.channels = score.topk(self.kept, dim=-1).indices.sort(dim=-1).values.to(self.shape.device)

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        index = self.channels[heads].unsqueeze(1).expand(-1, block.shape[1], -1)
        return {"channels": block.gather(2, index)}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        kept = encoded["channels"]
        out = torch.zeros(*kept.shape[:2], self.shape.dim, dtype=self.shape.dtype, device=kept.device)
        return out.scatter_(2, self.channels[heads].unsqueeze(1).expand(-1, kept.shape[1], -1), kept)

    def state_bytes(self) -> int:
        return 0 if self.channels is None else self.channels.numel() * self.channels.element_size()


@register("think")
@dataclass
class ThinK(LowRank):
    """ThinK (Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning"): key channels
    matter unequally to attention, so each head keeps the ``keep`` fraction of key channels with
    the largest query-key magnitude ``||Q_c|| ||K_c||`` over the prompt's last ``window`` queries;
    sealed pages store only those channels. Values are stored as they are.

    Channels are chosen per layer and KV head at the layer's first call, over the whole batch
    (ThinK chooses per sequence; one choice per head keeps page fields one shape).

    Args:
        keep: fraction of key channels kept, in (0, 1] (ThinK's pruning ratio is ``1 - keep``).
        window: queries at the end of the prompt that score the channels.
    """

    keep: float = 0.6
    window: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window}")

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return [PageCodec(ChannelPruner(key, self.keep, self.window), IdentityCodec(value), self.spec()) for key, value in shapes]
