"""CSKV: key and value channels shrunk to the leading singular directions of calibration K/V."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from kvlib.codec import PageCodec, TensorShape
from kvlib.model_identity import calibration_stamp, safetensors_metadata
from kvlib.model_shape import kv_shape
from kvlib.policies.lowrank.basis import BasisCodec, head_rows
from kvlib.policies.lowrank.svd import FittedBasisCodec
from kvlib.policy import LowRank
from kvlib.registry import register
from kvlib.transformers_compat import cache_argument

CALIBRATION_FORMAT = "kvlib-cskv-calibration-1"
"""The ``format`` entry of a calibration file's metadata."""


def calibrate_cskv(model: torch.nn.Module, input_ids: torch.Tensor, path: str | Path) -> Path:
    """The CSKV calibration of ``model`` on ``input_ids`` (int ``[batch, tokens]``, no padding):
    for every layer and KV head, the right singular vectors (all of them, strongest first) and
    singular values of the keys (after RoPE, as caches store them) and values the model computes
    for those tokens, written to ``path`` as safetensors (raw float32 tensors, nothing executable)
    with the model's fingerprint and a digest of the ids in its metadata.

    Cached: where ``path`` already holds a calibration of this model (its fingerprint) on these
    ids, it is kept and the model is not run. ``ValueError`` before any model work for ids that
    are not ``[batch, tokens]`` with at least one token. Returns ``path``."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"calibration needs input_ids [batch, tokens] with tokens >= 1, got shape {list(input_ids.shape)}")
    path = Path(path)
    stamp = calibration_stamp(model, input_ids, CALIBRATION_FORMAT) | {"tokens": str(input_ids.numel())}
    if path.is_file() and safetensors_metadata(path) == stamp:
        return path
    cache = DynamicCache(config=model.config)  # the model's own cache: its keys and values as computed
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids.to(device), use_cache=True, **cache_argument(cache))
    tensors = {}
    for layer in range(kv_shape(model).num_layers):
        for part, stored in (("keys", cache.layers[layer].keys), ("values", cache.layers[layer].values)):
            rows = head_rows(stored, torch.ones(stored.shape[:3], dtype=torch.bool, device=stored.device))
            _, singular, vh = torch.linalg.svd(rows, full_matrices=False)
            tensors[f"{layer}.{part}"] = vh.transpose(1, 2).contiguous().cpu()
            tensors[f"{layer}.{part}_singular"] = singular.contiguous().cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=stamp)
    return path


class ShrunkChannels(BasisCodec):
    """One layer's keys or values as their coefficients on the first ``rank`` calibrated singular
    directions of each KV head (:class:`~kvlib.policies.lowrank.basis.BasisCodec`, ready from the start)."""

    def __init__(self, shape: TensorShape, directions: torch.Tensor, rank: int) -> None:
        super().__init__(shape)
        self.set_basis(directions[:, :, :rank])


@register("cskv")
@dataclass
class CSKV(LowRank):
    """CSKV (Wang, Li, Ning, Yuan, Yan, Dai and Wang, 2024, "CSKV: Training-Efficient Channel
    Shrinking for KV Cache in Long-Context Scenarios", arXiv:2409.10593), its training-free part:
    the singular values of the KV cache fall fast along the channels, so keys and values are
    stored as low-dimension features, their coefficients on the leading singular directions, with
    a full-precision window of recent tokens beside them (the bi-branch cache).

    The directions come from calibration K/V, not from each prompt: :func:`calibrate_cskv` runs the
    model once on text (the project's own, e.g. :func:`kvlib.default_model.corpus.holdout_text`
    tokenized) and keeps, per layer and KV head, the SVD of the keys (after RoPE, as the cache
    stores them) and of the values; ``calibration`` names that file. Without one (``""``), the
    directions are those of the layer's first call (the prompt), as :class:`~.svd.SVD` fits them.
    CSKV initializes its down-projections the same way (SVD, or ASVD's activation-aware SVD) and
    then fine-tunes them layer by layer against the reconstruction loss; that training, which
    its 80% reduction rests on, is not done here. Each head keeps ``round(key_keep * head_dim)``
    key and ``round(value_keep * head_dim)`` value channels.

    The full-precision window is the open page: each head's newest ``1..page_size`` tokens stay in
    the compute dtype until their page is full (``make_cache(..., page_size=32)`` for CSKV's
    32-token window at its fullest). The Engine takes it with a calibration (one basis for every
    request's pages) and refuses it without (a basis per prompt).

    Args:
        key_keep: fraction of key channels kept per head, in (0, 1].
        value_keep: fraction of value channels kept per head, in (0, 1].
        calibration: a :func:`calibrate_cskv` file ("" : fit on each layer's first call).
    """

    key_keep: float = 0.5
    value_keep: float = 0.5
    calibration: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("key_keep", "value_keep"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.calibration and (safetensors_metadata(Path(self.calibration)) or {}).get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"calibration {self.calibration!r} is not a readable {CALIBRATION_FORMAT} file (make one with calibrate_cskv)")

    def _directions(self, shapes: list[tuple[TensorShape, TensorShape]]) -> dict[str, torch.Tensor]:
        """The calibration's tensors, checked against ``shapes`` (``ValueError`` naming the first mismatch)."""
        tensors = load_file(self.calibration)
        for key, value in shapes:
            for part, shape in (("keys", key), ("values", value)):
                held = tensors.get(f"{key.layer_idx}.{part}")
                wanted = (shape.kv_heads, shape.dim, shape.dim)
                if held is None or tuple(held.shape) != wanted:
                    found = None if held is None else list(held.shape)
                    raise ValueError(
                        f"calibration {self.calibration!r} does not fit this model: layer {key.layer_idx} {part} are {found},"
                        f" the model's {list(wanted)} (calibrate on this model)"
                    )
        return tensors

    @property
    def fits_each_prompt(self) -> bool:
        """Only without a calibration (then each layer fits its first call); a calibrated basis is
        fixed before any prompt, so pages of different prompts share it (the Engine's, a prefix
        store's)."""
        return not self.calibration

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        if self.calibration:
            self._directions(shapes)

    def _rank(self, keep: float, dim: int) -> int:
        return max(1, round(keep * dim))

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        if not self.calibration:
            return [
                PageCodec(
                    FittedBasisCodec(key, self._rank(self.key_keep, key.dim), 1.0),
                    FittedBasisCodec(value, self._rank(self.value_keep, value.dim), 1.0),
                    self.spec(),
                )
                for key, value in shapes
            ]
        tensors = self._directions(shapes)
        return [
            PageCodec(
                ShrunkChannels(key, tensors[f"{key.layer_idx}.keys"], self._rank(self.key_keep, key.dim)),
                ShrunkChannels(value, tensors[f"{value.layer_idx}.values"], self._rank(self.value_keep, value.dim)),
                self.spec(),
            )
            for key, value in shapes
        ]
