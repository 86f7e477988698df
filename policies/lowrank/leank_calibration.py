"""LeanK's mask learned on a model: two training stages on calibration text, cached per model and settings.

:func:`calibrate_leank` follows LeanK's training (Zhang et al. 2025, arXiv:2508.02215, and its
released code): every (layer, KV head, key channel) gets a scaling factor ``alpha`` in [0, 1],
initialized to 1, that multiplies that channel of the keys an answer query reads outside its
full-channel window (the first ``sink`` tokens and the ``recent`` tokens up to the query keep
every channel). The model's weights are frozen; the factors are trained with AdamW so that the
final hidden states at the answer's positions stay those of the unpruned model (mean squared
error) under an L1 penalty ``reg_weight * mean(|alpha|)``, clamped to [0, 1] before each step
(stage 1). The factors are then rounded to a mask (:func:`sparsify`: one global threshold
keeping the fraction ``keep`` of all channels, each head's count rounded to a multiple of
``align``, a head keeping its highest factors) and trained on through the mask with no penalty,
the mask recomputed each step and its gradient passed straight through (stage 2); the last
mask is saved. Prompt queries attend with every channel, as a prefill over full keys does.

Calibration text: :func:`copy_cases` generates passkey-style copy tasks from the model's
vocabulary (random tokens, a needle behind a marker, the marker again at the end and the needle
as the answer): LeanK trains on passkey retrieval, whose answers depend on reading far keys
exactly. Any :class:`CalibrationCase` list (real text with an answer) may be given instead.

:func:`calibrated_mask` runs the calibration once per (model fingerprint, settings, cases) and
keeps the mask file in a directory; later calls return the cached file.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvlib.model_identity import model_fingerprint
from kvlib.model_shape import attention_modules, kv_shape
from kvlib.policies.lowrank.leank import save_mask

CALIBRATION_ATTENTION = "kvlib_leank_calibration"
"""The attention implementation a model runs under during :func:`calibrate_leank` (registered in
``AttentionInterface`` when this module is imported; only the model being calibrated uses it)."""


@dataclass(frozen=True)
class CalibrationCase:
    """One calibration sequence: ``ids`` (the prompt, then its answer teacher-forced) and
    ``context``, the prompt's length in tokens. The queries at positions ``context - 1 ..
    len(ids) - 2`` produce the answer; they read far keys through the pruned channels and their
    hidden states are what the training keeps. Invariant: ``1 <= context < len(ids)``."""

    ids: tuple[int, ...]
    context: int

    def check(self) -> None:
        """``ValueError`` naming the broken invariant."""
        if not 1 <= self.context < len(self.ids):
            raise ValueError(f"a calibration case needs 1 <= context < len(ids) = {len(self.ids)}, got context={self.context}")


@dataclass(frozen=True)
class LeanKSettings:
    """What a LeanK calibration is run with (and what its cache key names).

    keep: fraction of all key channels kept, in (0, 1] (LeanK's ``1 - ratio``). align: each head
    keeps a multiple of this many channels (LeanK's hardware alignment). sink, recent: tokens at
    the start and up to each answer query that keep every channel during training. stage1_steps,
    stage2_steps: AdamW steps of each stage (one case per step, cycling). stage1_lr, stage2_lr:
    their learning rates. reg_weight: the L1 penalty's weight in stage 1.
    """

    keep: float = 0.5
    align: int = 8
    sink: int = 4
    recent: int = 16
    stage1_steps: int = 40
    stage2_steps: int = 10
    stage1_lr: float = 0.02
    stage2_lr: float = 0.01
    reg_weight: float = 0.06

    def check(self) -> None:
        """``ValueError`` naming the first setting out of range."""
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        for name in ("align", "stage1_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}")
        for name in ("sink", "recent", "stage2_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)}")
        for name in ("stage1_lr", "stage2_lr", "reg_weight"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be a float >= 0, got {getattr(self, name)}")


def copy_cases(vocab_size: int, count: int = 4, length: int = 128, needle: int = 6, seed: int = 0) -> list[CalibrationCase]:
    """``count`` passkey-style copy cases of ``length`` tokens: random tokens from ``[3, vocab_size)``
    (ids below 3, often special, left out), a 2-token marker and a ``needle`` of random tokens at a
    random depth, and at the end the marker again followed by the needle (the answer)."""
    if vocab_size < 8 or count < 1 or needle < 1 or length < 3 * needle + 8:
        raise ValueError(
            f"copy_cases needs vocab_size >= 8, count >= 1, needle >= 1 and length >= 3 * needle + 8, got {vocab_size}, {count}, {length}, {needle}"
        )
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(count):
        ids = torch.randint(3, vocab_size, (length,), generator=generator)
        marker, value = ids[:2].clone(), torch.randint(3, vocab_size, (needle,), generator=generator)
        context = length - needle
        depth = int(torch.randint(2, context - 2 * needle - 6, (1,), generator=generator))
        ids[depth : depth + 2], ids[depth + 2 : depth + 2 + needle] = marker, value
        ids[context - 2 : context], ids[context:] = marker, value
        cases.append(CalibrationCase(tuple(ids.tolist()), context))
    return cases


def sparsify(alphas: torch.Tensor, keep: float, align: int) -> torch.Tensor:
    """LeanK's rounding of scaling factors ``alphas`` (float ``[layers, kv_heads, head_dim]``) to a
    bool mask of the same shape: the channels at or above the global ``1 - keep`` quantile are
    counted per head, each count rounded to the nearest multiple of ``align`` (ties up, at most
    ``head_dim``), and each head keeps that many of its highest factors (ties by channel index)."""
    flat = alphas.float().flatten()
    threshold = torch.quantile(flat, 1.0 - keep) if keep < 1.0 else flat.min()
    counts = (alphas.float() >= threshold).sum(-1)
    counts = ((counts + align // 2) // align * align).clamp(max=alphas.shape[-1])
    order = torch.sort(alphas.float(), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(alphas.shape[-1], device=order.device).expand_as(order))
    return rank < counts.unsqueeze(-1)


@dataclass
class _Training:
    """What the calibration attention reads during one forward: the factors of each model layer's
    attention module (``[kv_heads, head_dim]``, by the module's ``layer_idx``), the answer's
    first query position, and the full-channel window."""

    alphas: dict[int, torch.Tensor]
    context: int
    sink: int
    recent: int


_TRAINING: contextvars.ContextVar[_Training | None] = contextvars.ContextVar("kvlib_leank_training", default=None)


def _calibration_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention in float32 in which answer queries read far keys through the scaled
    channels (see the module docstring); ``[batch, queries, heads, dim]`` and the weights."""
    training = _TRAINING.get()
    if training is None:
        raise RuntimeError(f"{CALIBRATION_ATTENTION} runs only inside kvlib's LeanK calibration")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    keys = key.float()
    scaled = keys * training.alphas[module.layer_idx].unsqueeze(1)
    q = query.float()
    full = q @ keys.repeat_interleave(groups, 1).transpose(-1, -2) * scaling
    pruned = q @ scaled.repeat_interleave(groups, 1).transpose(-1, -2) * scaling
    length, total = query.shape[2], key.shape[2]
    i = torch.arange(total - length, total, device=q.device).unsqueeze(-1)
    j = torch.arange(total, device=q.device)
    far = (i - j >= training.recent) & (j >= training.sink) & (i >= training.context - 1)
    logits = torch.where(far, pruned, full)
    if attention_mask is not None:
        logits = logits + attention_mask[..., :total].float()
    weights = logits.softmax(-1)
    out = weights @ value.float().repeat_interleave(groups, 1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), weights


AttentionInterface.register(CALIBRATION_ATTENTION, _calibration_attention)
AttentionMaskInterface.register(CALIBRATION_ATTENTION, eager_mask)


@contextmanager
def _calibrating(model: torch.nn.Module) -> Iterator[None]:
    """The model under the calibration attention with frozen weights, restored after."""
    previous = model.config._attn_implementation
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_attn_implementation(CALIBRATION_ATTENTION)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        model.set_attn_implementation(previous)
        for name, p in model.named_parameters():
            p.requires_grad_(grads[name])


def _final_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False, output_hidden_states=True).hidden_states[-1]


def calibrate_leank(model: torch.nn.Module, cases: Sequence[CalibrationCase], path: str | Path, settings: LeanKSettings) -> torch.Tensor:
    """Learn LeanK's key-channel mask for ``model`` on ``cases`` (see the module docstring), save
    it to ``path`` and return it: bool ``[layers, kv_heads, head_dim]`` (True: kept). ``ValueError``
    before any model work for bad settings, no cases, a broken case, or a model whose KV layers
    differ in KV heads or head size."""
    settings.check()
    if not cases:
        raise ValueError("calibrate_leank needs at least one case")
    for case in cases:
        case.check()
    shape = kv_shape(model)
    layers, heads, dim = shape.num_layers, shape.num_kv_heads, shape.head_dim  # one layout for every layer, or ValueError
    modules = attention_modules(model, shape)
    device = next(model.parameters()).device
    inputs = [torch.tensor([case.ids], device=device) for case in cases]
    with torch.no_grad():
        references = [_final_hidden(model, ids)[0, case.context - 1 : -1].float() for ids, case in zip(inputs, cases)]
    with _calibrating(model):
        alphas = torch.ones(layers, heads, dim, device=device, requires_grad=True)  # trainable even if called in inference mode
        for stage, steps, lr, reg in (
            (1, settings.stage1_steps, settings.stage1_lr, settings.reg_weight),
            (2, settings.stage2_steps, settings.stage2_lr, 0.0),
        ):
            optimizer = torch.optim.AdamW([alphas], lr=lr, weight_decay=0.0)
            for step in range(steps):
                with torch.no_grad():
                    alphas.clamp_(0.0, 1.0)
                    mask = sparsify(alphas, settings.keep, settings.align) if stage == 2 else None
                used = alphas if mask is None else alphas + (alphas * mask - alphas).detach()  # straight-through
                case = cases[step % len(cases)]
                by_module = {module.layer_idx: used[layer] for layer, module in enumerate(modules)}
                token = _TRAINING.set(_Training(by_module, case.context, settings.sink, settings.recent))
                try:
                    hidden = _final_hidden(model, inputs[step % len(cases)])[0, case.context - 1 : -1].float()
                finally:
                    _TRAINING.reset(token)
                loss = (hidden - references[step % len(cases)]).square().mean() + reg * alphas.abs().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    with torch.no_grad():
        alphas.clamp_(0.0, 1.0)
        mask = sparsify(alphas.detach().cpu(), settings.keep, settings.align)
    channels = [[torch.nonzero(head).flatten().tolist() for head in layer] for layer in mask]
    save_mask(path, channels, asdict(settings) | {"cases": len(cases)})
    return mask


def calibrated_mask(
    model: torch.nn.Module,
    directory: str | Path,
    settings: LeanKSettings | None = None,
    cases: Sequence[CalibrationCase] | None = None,
) -> Path:
    """The path of ``model``'s LeanK mask for ``settings`` (default :class:`LeanKSettings`) learned
    on ``cases`` (default :func:`copy_cases` from the model's vocabulary), in ``directory``:
    learned by :func:`calibrate_leank` on the first call and kept there under a name hashed from
    the model's fingerprint (:func:`~kvlib.model_identity.model_fingerprint`: class, config,
    weights), the settings and the cases' tokens; later calls return the file. Pass it as
    ``leank(mask=str(path))``."""
    settings = settings or LeanKSettings()
    settings.check()
    if cases is None:
        cases = copy_cases(model.config.get_text_config().vocab_size)
    key = hashlib.sha256(model_fingerprint(model))
    key.update(json.dumps(asdict(settings), sort_keys=True).encode())
    key.update(json.dumps([[case.context, *case.ids] for case in cases]).encode())
    folder = Path(directory)
    path = folder / f"leank-{key.hexdigest()[:32]}.json"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(dir=folder, prefix=".leank-", suffix=".json")
        os.close(handle)
        try:
            calibrate_leank(model, cases, scratch, settings)
            os.replace(scratch, path)
        finally:
            Path(scratch).unlink(missing_ok=True)
    return path
