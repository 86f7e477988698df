"""Which model computed a page: a fingerprint of the model's class, config and every weight.

KV reused from a store (:class:`~kvlib.PrefixStore`, its disk directory, :class:`~kvlib.ChunkStore`)
is only right for the model that computed it, so every key those stores use includes
:func:`model_fingerprint`. Two models get the same fingerprint only when they have the same
class, the same config (``_name_or_path`` aside: where the files came from does not change the
KV) and equal parameters and persistent buffers: every byte of every tensor, with its name,
shape and dtype. A fine-tuned or edited model (one value changed in the middle of one tensor)
therefore never meets the original's pages.

What is not hashed: non-persistent buffers (rotary frequencies, causal masks), which the model's
code derives from its config and which some models recompute during a forward pass (dynamic
RoPE); the device (the namespace of a store carries it); a tokenizer: a page holds the KV of
token ids, which depends on the model alone, so keys are token ids and the model.

Cost: hashing reads every weight once (SHA-256, which runs on the CPU's SHA instructions: 0.7-0.8
GB/s here, about twice blake2b's rate on the same CPU; 0.6-0.75 s for a ~100M float32 Llama;
weights on an accelerator are copied to the host one tensor at a time). The result is cached per model object and reused
while the object's weights are unchanged: a check walks the modules and compares each
tensor's identity, storage address and autograd version counter, and compares the config
(0.6-0.9 ms for a 12-layer model), so asking again per request is cheap. An in-place
edit (under ``torch.no_grad()``, by an optimizer, ``load_state_dict``, ``.to()``) moves the
version counter or the storage and the next call hashes again. Edits that bypass the version
counter (through ``.data``, a NumPy view of a weight, or an inference tensor edited inside
``torch.inference_mode()``) are not seen by the cached check: treat a model edited that way as
a new model (a new store), or call :func:`forget_fingerprint` first.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open

FINGERPRINT_VERSION = 2
"""Hashed first: a change to what the fingerprint covers changes every key (version 1 sampled
the first and last 8 values of each parameter), so records on disk written under another
version are misses, never another model's pages."""


@dataclass(frozen=True)
class _Cached:
    stamp: list[tuple[int, int, int]]
    settings: dict
    fingerprint: bytes


_cache: weakref.WeakKeyDictionary[torch.nn.Module, _Cached] = weakref.WeakKeyDictionary()
"""The fingerprint of each model object seen, with the state it was taken in."""


def model_fingerprint(model: torch.nn.Module) -> bytes:
    """16 bytes naming ``model``'s class, config and weights (see the module docstring); taken
    from the per-object cache while the weights' version stamp and the config are unchanged."""
    stamp, settings = _stamp(model), _settings(model)
    cached = _cache.get(model)
    if cached is not None and cached.stamp == stamp and cached.settings == settings:
        return cached.fingerprint
    config = json.dumps(settings, sort_keys=True, default=repr)
    digest = hashlib.sha256(f"kvlib model fingerprint v{FINGERPRINT_VERSION}\n{config}\n".encode())
    with torch.no_grad():
        for name, tensor in _weights(model):
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
            digest.update(_raw_bytes(tensor))
    fingerprint = digest.digest()[:16]
    _cache[model] = _Cached(stamp, settings, fingerprint)
    return fingerprint


def calibration_stamp(model: torch.nn.Module, input_ids: torch.Tensor, format: str) -> dict[str, str]:
    """The metadata naming a calibration file of ``format`` made on ``model`` (its fingerprint) from
    ``input_ids`` (a digest of the int64 ids): a file whose metadata equals it holds that
    calibration and need not be made again (:func:`safetensors_metadata` reads it back)."""
    return {
        "format": format,
        "model": model_fingerprint(model).hex(),
        "ids": hashlib.blake2b(input_ids.cpu().to(torch.int64).numpy().tobytes(), digest_size=16).hexdigest(),
    }


def safetensors_metadata(path: str | Path) -> dict[str, str] | None:
    """The metadata of the safetensors file at ``path``, or None where there is no readable one."""
    try:
        with safe_open(str(path), "pt") as handle:
            return handle.metadata()
    except (OSError, SafetensorError):
        return None


def forget_fingerprint(model: torch.nn.Module) -> None:
    """Drop ``model``'s cached fingerprint, so the next use hashes its weights again (after an
    edit the version counters do not see, such as one through ``.data``)."""
    _cache.pop(model, None)


class ModelIdentity:
    """A model's fingerprint, and a check that a model (the same object or another) has it:
    per request that costs a version check of the model's tensors, not a hash of its weights
    (unless they changed, or the model object is new)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.fingerprint = model_fingerprint(model)

    def matches(self, model: torch.nn.Module) -> bool:
        return model_fingerprint(model) == self.fingerprint


def _weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of ``model`` by qualified name, in module order,
    each tensor once (a tied weight under its first name)."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for name, tensor in _own_weights(module):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield (f"{prefix}.{name}" if prefix else name), tensor


def _own_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and persistent buffers ``module`` registers itself (not its children's)."""
    for name, tensor in module._parameters.items():
        if tensor is not None:
            yield name, tensor
    for name, tensor in module._buffers.items():
        if tensor is not None and name not in module._non_persistent_buffers_set:
            yield name, tensor


def _stamp(model: torch.nn.Module) -> list[tuple[int, int, int]]:
    """Per weight tensor: its identity, storage address and version counter (-1 for inference
    tensors, which have none). Equal stamps mean no tracked change to any weight."""
    return [
        (id(tensor), tensor.data_ptr(), -1 if tensor.is_inference() else tensor._version)
        for module in model.modules()
        for _, tensor in _own_weights(module)
    ]


def _settings(model: torch.nn.Module) -> dict:
    """The model's class and config (every setting but ``_name_or_path``: where it was loaded from)."""
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    settings.pop("_name_or_path", None)
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}", "config": settings}


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's values as bytes, from a contiguous host copy (any dtype, bfloat16 and fp8 too)."""
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy())
