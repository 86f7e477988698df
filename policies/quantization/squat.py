"""SQuat: keys quantized so that their error stays out of the prompt's query subspace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvlib.codec import FitSample, PageCodec, TensorShape
from kvlib.kernels.packing import pack
from kvlib.model_identity import calibration_stamp, safetensors_metadata
from kvlib.model_shape import attention_modules, kv_shape
from kvlib.policies.quantization.kivi import check_bits, check_group, check_value_groups
from kvlib.policies.quantization.uniform import GroupQuantizer, dequantize_min_max, quantize_min_max
from kvlib.policy import Quantization
from kvlib.registry import register

CALIBRATION_FORMAT = "kvlib-squat-calibration-1"
"""The ``format`` entry of a calibration file's metadata."""
QUERY_CAPTURE = "kvlib_squat_query_capture"
"""The attention implementation :func:`calibrate_squat` switches a model to for its one pass:
transformers' SDPA, recording each attention module's queries (after RoPE) in the dict passed as
the model call's ``squat_queries`` keyword. Registered in transformers' ``AttentionInterface``
under this name only; no other implementation changes."""


def _capturing_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    captured = kwargs.pop("squat_queries", None)
    if captured is not None:
        captured[module] = query.detach()
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(QUERY_CAPTURE, _capturing_sdpa)
AttentionMaskInterface.register(QUERY_CAPTURE, sdpa_mask)


def calibrate_squat(model: torch.nn.Module, input_ids: torch.Tensor, path: str | Path) -> Path:
    """SQuat's query subspaces of ``model`` on ``input_ids`` (int ``[batch, tokens]``, no padding):
    per layer and KV head, every direction of :func:`query_subspace` (``S V^T`` of the queries
    after RoPE, strongest first, ``[kv_heads, head_dim, head_dim]``), written to ``path`` as
    safetensors (raw float32 tensors, nothing executable) with the model's fingerprint and a digest
    of the ids in its metadata.

    Cached: where ``path`` already holds a calibration of this model on these ids, it is kept and
    the model is not run. One pass with the attention implementation :data:`QUERY_CAPTURE`
    (switched for the pass and restored after it). ``ValueError`` before any model work for ids
    that are not ``[batch, tokens]`` with at least one token. Returns ``path``."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"calibration needs input_ids [batch, tokens] with tokens >= 1, got shape {list(input_ids.shape)}")
    shape = kv_shape(model)
    path = Path(path)
    stamp = calibration_stamp(model, input_ids, CALIBRATION_FORMAT)
    if path.is_file() and safetensors_metadata(path) == stamp:
        return path
    modules = attention_modules(model, shape)
    captured: dict[torch.nn.Module, torch.Tensor] = {}
    previous = model.config._attn_implementation
    model.set_attn_implementation(QUERY_CAPTURE)
    try:
        with torch.no_grad():
            model(input_ids.to(next(model.parameters()).device), use_cache=False, squat_queries=captured)
    finally:
        model.set_attn_implementation(previous)
    real = torch.ones(input_ids.shape, dtype=torch.bool)
    tensors = {}
    for layer, module in enumerate(modules):
        queries = captured[module]
        tensors[str(layer)] = query_subspace(queries, real, shape.layer_kv_heads[layer], queries.shape[-1]).cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=stamp)
    return path


def query_subspace(queries: torch.Tensor, query_valid: torch.Tensor, kv_heads: int, rank: int) -> torch.Tensor:
    """float32 ``[kv_heads, r, head_dim]``: per KV head, the top ``r = min(rank, head_dim)`` right
    singular vectors of the real ``queries`` (``[batch, query_heads, q_len, head_dim]``, real where
    ``query_valid`` ``[batch, q_len]``; every query head of the KV group, every row of the batch
    stacked), each scaled by its singular value (SQuat's ``S_r V_r^T``). Directions the queries do
    not reach (fewer real query rows than ``r``) come with singular value 0."""
    queries = queries.float()
    batch, query_heads, length, dim = queries.shape
    real = query_valid.to(queries.device).view(batch, 1, length, 1)
    rows = (queries * real).view(batch, kv_heads, query_heads // kv_heads, length, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
    _, singular, vh = torch.linalg.svd(rows, full_matrices=False)
    r = min(rank, dim)
    basis = singular[:, :r].unsqueeze(-1) * vh[:, :r]
    return torch.nn.functional.pad(basis, (0, 0, 0, r - basis.shape[1]))  # fewer rows than r: zero directions


def compensation_gains(subspace: torch.Tensor, lam: float, blocks: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """SQuat's error propagation for keys quantized in ``blocks`` channel blocks, in order.

    A key ``k`` decoded as ``k'`` costs ``(k' - k)^T A (k' - k)`` with ``A = I + lam Q^T Q``
    (``Q = subspace`` ``[heads, r, dim]``: the penalty of error inside the query subspace, a
    Lagrangian relaxation of ``Q (k' - k) = 0``). Once block ``b`` is quantized with error ``e_b``,
    the later channels' cost-minimizing targets move by ``G_b e_b``, ``G_b = -A_rr^{-1} A_rb``
    (``r``: the channels after block ``b``; the sequential, GPTQ-like update that makes the final
    error orthogonal to the subspace as ``lam`` grows, where the later channels can absorb it).
    Returns ``G_b`` ``[heads, channels after b, block]`` for every block but the last, solved in
    float64 and returned in ``dtype`` (float32: what the codec applies).
    """
    heads, _, dim = subspace.shape
    q = subspace.double()
    cost = torch.eye(dim, dtype=torch.float64, device=q.device) + lam * q.transpose(1, 2) @ q
    size = dim // blocks
    gains = []
    for block in range(blocks - 1):
        start, rest = block * size, (block + 1) * size
        solved = torch.linalg.solve(cost[:, rest:, rest:], cost[:, rest:, start:rest])
        gains.append((-solved).to(dtype))
    return gains


class SubspaceOrthogonalKeys(GroupQuantizer):
    """Keys in KIVI's layout (each channel quantized across the page's tokens, fields ``codes``,
    ``scale``, ``minimum``: decoded and read by the paged kernels as a per-channel
    :class:`~kvlib.policies.quantization.uniform.GroupQuantizer`'s), with the codes chosen by SQuat:
    the channels are quantized in ``blocks`` blocks of ``head_dim / blocks``, and each block's
    quantization error moves the targets of the later channels by :func:`compensation_gains`.

    Fitted at the layer's first call (:meth:`observe`: the query subspace of its real queries; the
    layer's full pages wait open until then), or ready from the start with a calibrated ``subspace``. Invariant: with ``lam = 0`` (or a zero subspace) the
    codes are a plain per-channel quantizer's. State: the gains (float32; the subspace itself is
    not kept).
    """

    def __init__(self, shape: TensorShape, bits: int, rank: int, lam: float, blocks: int, subspace: torch.Tensor | None = None) -> None:
        super().__init__(shape, bits, per_channel=True)
        self.rank, self.lam, self.blocks = rank, lam, blocks
        self.gains: list[torch.Tensor] | None = None
        """:func:`compensation_gains` of the fitted subspace, on the layer's device; None until fitted."""
        self.learns = subspace is None
        """Whether it fits at the layer's first call (no calibrated ``subspace`` given)."""
        if subspace is not None:
            self.set_subspace(subspace[:, :rank])

    @property
    def ready(self) -> bool:
        return self.gains is not None

    def observe(self, sample: FitSample, part: str) -> None:
        self.set_subspace(query_subspace(sample.queries, sample.query_valid, self.shape.kv_heads, self.rank))

    def set_subspace(self, subspace: torch.Tensor) -> None:
        """Quantize from now on against ``subspace`` float ``[kv_heads, r, head_dim]`` (:func:`query_subspace`)."""
        self.gains = [gain.to(self.shape.device) for gain in compensation_gains(subspace, self.lam, self.blocks)]

    def encode(self, block: torch.Tensor, heads: torch.Tensor) -> dict[str, torch.Tensor]:
        target = block.float().clone()
        n, size, dim = target.shape
        step = dim // self.blocks
        codes = torch.empty(n, size, dim, dtype=torch.uint8, device=target.device)
        scale = torch.empty(n, dim, dtype=self.meta, device=target.device)
        minimum = torch.empty_like(scale)
        for index in range(self.blocks):
            start, end = index * step, (index + 1) * step
            part = target[:, :, start:end].transpose(1, 2)  # each channel one group across the page's tokens
            part_codes, scale[:, start:end], minimum[:, start:end] = quantize_min_max(part, self.bits, self.meta)
            codes[:, :, start:end] = part_codes.transpose(1, 2)
            if index < self.blocks - 1:
                error = (dequantize_min_max(part_codes, scale[:, start:end], minimum[:, start:end]) - part).transpose(1, 2)
                target[:, :, end:] += torch.bmm(error, self.gains[index][heads.to(target.device)].transpose(1, 2))
        return {"codes": pack(codes.reshape(n, -1), self.bits), "scale": scale, "minimum": minimum}

    def state_bytes(self) -> int:
        return sum(gain.numel() * gain.element_size() for gain in self.gains or [])


@register("squat")
@dataclass
class SQuat(Quantization):
    """SQuat (Wang, Han, Xu and Srivastava, 2025, "SQuat: Subspace-orthogonal KV Cache
    Quantization", arXiv:2503.24358): the queries of the prompt span a small subspace per KV head
    that carries what the task asks; keys are quantized so that their error stays (as nearly as
    the Lagrangian relaxation gets) orthogonal to it, so the attention scores of queries in it
    barely change. Values are quantized as KIVI's (per token, groups of ``group`` channels).

    The subspace is fitted at each layer's first attention call (the prompt) from its real queries
    after RoPE, every query head of a KV group and every row of the batch together (the paper's
    ``shared_svd`` option, on post-RoPE keys: its ``squat_post`` variant): ``Q = S_r V_r^T``, the
    top ``rank`` right singular vectors scaled by their singular values. A key's decoded error
    ``e`` costs ``|e|^2 + lam |Q e|^2``; channels are quantized in ``blocks`` blocks (KIVI's key
    layout: each channel across the page's tokens, the page being the token group), each block's
    error moving the later channels' targets to the cost's minimum given it
    (:func:`compensation_gains`). The codes are KIVI's layout, so pages hold exactly
    ``kivi(bits)``'s bytes and are read in place by the same paged kernel; the gains are per-layer
    state. SQuat needs no calibration text: the fit is the prompt's.

    With ``calibration`` (a :func:`calibrate_squat` file: the model's queries on calibration text,
    e.g. the project's holdout), every layer takes that subspace instead, ready from the start: one
    subspace for every prompt, which the Engine can use (its pages are shared by requests, and it
    hands codecs no prompt call to fit on: there an uncalibrated SQuat layer is never fitted and its
    pages stay in the compute dtype).

    Defaults are the paper's released runs (``squat_lambda=0.001``, ``subspace_dim=60``, 2-bit
    keys and values, value groups of 32), with ``blocks=2``: its 64-channel blocks of Llama's
    128-channel heads (on a 64-channel head such as SmolLM2's, one 64-channel block would leave
    nothing to compensate).

    Args:
        bits: bits per key and value element, 2, 3, 4 or 8.
        rank: subspace dimension per KV head (clamped to the head dim), >= 1.
        lam: weight of the error inside the subspace, >= 0 (0: KIVI's codes).
        blocks: channel blocks quantized in turn; must divide the key head dim.
        group: value channels per quantization group, as :class:`~.kivi.KIVI`'s.
        calibration: a :func:`calibrate_squat` file ("": fit on each layer's first call).
    """

    bits: int = 2
    rank: int = 60
    lam: float = 0.001
    blocks: int = 2
    group: int = 32
    calibration: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits("bits", self.bits)
        check_group(self.group)
        if self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        if not self.lam >= 0:
            raise ValueError(f"lam must be a float >= 0, got {self.lam!r}")
        if self.blocks < 1:
            raise ValueError(f"blocks must be an int >= 1, got {self.blocks!r}")
        if self.calibration and (safetensors_metadata(Path(self.calibration)) or {}).get("format") != CALIBRATION_FORMAT:
            raise ValueError(
                f"calibration {self.calibration!r} is not a readable {CALIBRATION_FORMAT} file (make one with calibrate_squat)"
            )

    def check_shape(self, shapes: list[tuple[TensorShape, TensorShape]]) -> None:
        check_value_groups(self.group, shapes)
        for key, _ in shapes:
            if key.dim % self.blocks:
                valid = [b for b in range(1, key.dim + 1) if key.dim % b == 0]
                raise ValueError(f"blocks={self.blocks} does not divide the key head dim {key.dim} (layer {key.layer_idx}); valid: {valid}")
        self._subspaces(shapes)

    def _subspaces(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[torch.Tensor | None]:
        """Each layer's calibrated subspace (None each without ``calibration``); ``ValueError``
        naming the first layer the file does not fit."""
        if not self.calibration:
            return [None] * len(shapes)
        tensors = load_file(self.calibration)
        for key, _ in shapes:
            held = tensors.get(str(key.layer_idx))
            wanted = (key.kv_heads, key.dim, key.dim)
            if held is None or tuple(held.shape) != wanted:
                found = None if held is None else list(held.shape)
                raise ValueError(
                    f"calibration {self.calibration!r} does not fit this model: layer {key.layer_idx}'s subspace is {found},"
                    f" the model's {list(wanted)} (calibrate on this model)"
                )
        return [tensors[str(key.layer_idx)] for key, _ in shapes]

    def layer_codecs(self, shapes: list[tuple[TensorShape, TensorShape]]) -> list[PageCodec]:
        return [
            PageCodec(
                SubspaceOrthogonalKeys(key, self.bits, self.rank, self.lam, self.blocks, subspace),
                GroupQuantizer(value, self.bits, per_channel=False, group=self.group),
                self.spec(),
            )
            for (key, value), subspace in zip(shapes, self._subspaces(shapes))
        ]
