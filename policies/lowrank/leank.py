"""LeanK: a static, learned per-head mask of key channels; only the kept channels are stored."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlib.codec import Field, IdentityCodec, PageCodec, TensorCodec, TensorShape
from kvlib.kernel_readers import KernelReader
from kvlib.policy import LowRank
from kvlib.registry import register

MASK_FORMAT = "kvlib-leank-mask/1"
"""The ``format`` field of a saved LeanK mask (JSON; nothing in it is executed)."""


def load_mask(path: str) -> list[list[list[int]]]:
    """The kept key channels of a saved mask: ``channels[layer][kv_head]``, each a strictly ascending
    list of channel indices (possibly empty: LeanK may prune a head's keys whole). ``ValueError``
    naming the file and what is wrong with it (missing, not JSON, another format, a malformed list)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"leank mask {path!r} is not a file: write one with kvlib.policies.lowrank.leank_calibration.calibrated_mask(model)"
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"leank mask {path!r} is not readable JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != MASK_FORMAT:
        raise ValueError(f"leank mask {path!r} is not a {MASK_FORMAT!r} file")
    channels = data.get("channels")
    if not isinstance(channels, list) or not channels or not all(isinstance(layer, list) and layer for layer in channels):
        raise ValueError(f"leank mask {path!r}: 'channels' must be a non-empty list (layers) of non-empty lists (KV heads)")
    for layer in channels:
        for head in layer:
            ok = isinstance(head, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in head)
            if not ok or any(a >= b for a, b in zip(head, head[1:])):
                raise ValueError(f"leank mask {path!r}: each head's kept channels must be ascending distinct ints >= 0, got {head!r}")
    return channels


def save_mask(path: str | Path, channels: Sequence[Sequence[Sequence[int]]], settings: dict) -> None:
    """Write ``channels[layer][kv_head]`` (ascending kept channel indices) as a mask file, with the
    ``settings`` that produced it (recorded, not read back)."""
    kept = [[[int(c) for c in head] for head in layer] for layer in channels]
    Path(path).write_text(json.dumps({"format": MASK_FORMAT, "settings": settings, "channels": kept}))


class StaticChannelMask(TensorCodec):
    """Keeps each head's listed key channels of a sealed page; pruned channels read back as zero,
    so ``q . k`` over a sealed page is the query's product with the kept channels only (the query
    is masked by the same mask, in effect).

    Every page of a layer has one field shape: ``[page_size, width]`` with ``width`` the most
    channels any head of the layer keeps (at least 1). A head keeping fewer stores zeros in the
    rest of its width (``slots`` marks them), so its pages take the layer's width; with LeanK's
    ``align`` rounding, heads of a layer mostly keep the same count."""

    def __init__(self, shape: TensorShape, kept: Sequence[Sequence[int]]) -> None:
        super().__init__(shape)
        width = max(1, max(len(head) for head in kept))
        padded = [list(head) + [0] * (width - len(head)) for head in kept]
        self.width = width
        self.channels = torch.tensor(padded, dtype=torch.int64, device=shape.device)
        """int64 ``[kv_heads, width]``: each head's kept channels, ascending, then 0 where unused."""
        self.slots = torch.tensor([[i < len(head) for i in range(width)] for head in kept], device=shape.device)
        """bool ``[kv_heads, width]``: which entries of :attr:`channels` are kept channels."""

    @property
    def fields(self) -> dict[str, Field]:
        return {"channels": Field((self.shape.page_size, self.width), self.shape.dtype)}

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        index = self.channels[heads].unsqueeze(1).expand(-1, block.shape[1], -1)
        kept = block.gather(2, index) * self.slots[heads].unsqueeze(1).to(block.dtype)
        return {"channels": kept}

    def decode(self, encoded: dict[str, torch.Tensor], heads: torch.Tensor) -> torch.Tensor:
        kept = encoded["channels"]
        out = torch.zeros(*kept.shape[:2], self.shape.dim, dtype=self.shape.dtype, device=kept.device)
        index = self.channels[heads].unsqueeze(1).expand(-1, kept.shape[1], -1)
        return out.scatter_add_(2, index, kept)  # unused entries add their zeros to channel 0

    def state_bytes(self) -> int:
        return self.channels.numel() * self.channels.element_size() + self.slots.numel() * self.slots.element_size()

    def kernel_reader(self, arenas: dict[str, torch.Tensor]) -> KernelReader:
        """``"channel_mask"``: each page's kept channels scored against the query's same channels,
        gathered once (:mod:`~kvlib.policies.lowrank.page_readers`). No Triton loader: on CUDA a
        LeanK layer is read densely."""
        return KernelReader("channel_mask", (arenas["channels"], torch.where(self.slots, self.channels, -1)), (self.width,))


@register("leank")
@dataclass
class LeanK(LowRank):
    """LeanK (Zhang et al., 2025, "LeanK: Learnable K Cache Channel Pruning for Efficient Decoding",
    EMNLP 2025, arXiv:2508.02215): key channels are statically sparse, so a per-(layer, KV head)
    channel mask learned offline prunes them for every prompt; sealed pages store only the kept key
    channels, and attention over them uses those channels only. Values are stored as they are.

    The mask is learned by :func:`~kvlib.policies.lowrank.leank_calibration.calibrated_mask`
    (LeanK's two stages: a scaling factor in [0, 1] per key channel trained to keep the model's
    output under an L1 penalty, then rounded to a mask of a global kept fraction with each head's
    count a multiple of ``align``, and trained on through the mask), cached per model and
    settings; this policy reads the file it writes. Each head's open page (its newest
    ``< page_size`` tokens) keeps every channel: LeanK's full-channel window of recent tokens.
    Unlike LeanK, the first (sink) tokens are pruned like the rest once their page seals.

    Args:
        mask: path of the mask file (``MASK_FORMAT``), for the model the cache is made for (its
            layer count, KV heads and head size are checked before any model work).
    """

    fits_each_prompt = False  # one mask for every prompt: pages of different prompts share it (the Engine's)

    mask: str
    channels: list = field(init=False, repr=False, compare=False, default_factory=list)
    """The loaded mask: ``channels[layer][kv_head]``, ascending kept channel indices."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "channels", load_mask(self.mask))

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        heads = [key.kv_heads for key, _ in shapes]
        mask_heads = [len(layer) for layer in self.channels]
        if mask_heads != heads:
            raise ValueError(
                f"leank mask {self.mask!r} is for {len(mask_heads)} layers with KV heads {mask_heads}, but the model has"
                f" {len(heads)} layers with KV heads {heads}: calibrate a mask for this model"
            )
        for (key, _), layer in zip(shapes, self.channels):
            top = max((head[-1] for head in layer if head), default=-1)
            if top >= key.dim:
                raise ValueError(
                    f"leank mask {self.mask!r} keeps channel {top} of layer {key.layer_idx}, whose keys have {key.dim} channels"
                )

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        self.check_shape(shapes)
        return [
            PageCodec(StaticChannelMask(key, kept), IdentityCodec(value), self.spec()) for (key, value), kept in zip(shapes, self.channels)
        ]
