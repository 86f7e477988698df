"""The kvpress side of ``benchmarks/kvpress_parity.py``, run by the kvpress virtual environment's python.

It imports only torch, transformers and kvpress (never kvlib). It reads one JSON request from stdin:

    {"model": folder, "threads": 1, "max_new_tokens": N, "eos": [ids],
     "jobs": [{"method": name, "press": {"class": "SnapKVPress", "kwargs": {...}}, "ratio": r,
               "budget": kept fraction, "case": i, "ids": [token ids]}, ...]}

where a press kwarg that is itself ``{"class": ..., "kwargs": ...}`` builds a nested press (ChunkKV's
scorer). For each job it runs the prompt once under ``press(model)`` (kvpress compresses every
layer after its prefill attention: its pipeline's semantics), records for each layer and KV head the
original positions the press kept, then decodes greedily with no further compression, as kvpress's
pipeline does (``position_ids`` continue from the prompt's length). It writes one JSON line per job
to stdout: ``{"method", "budget", "case", "kept": [layer][head] -> sorted positions, "tokens": [ids]}``.

Kept positions are recovered without touching kvpress's code: the outermost press's ``compress`` is
wrapped, and each kept key row is matched to the identical row of the keys it was given (keys carry
RoPE, so two positions never share a row; a gather copies rows exactly).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kvpress  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

EAGER = {"ObservedAttentionPress", "KVComposePress"}
"""Presses that read the attention weights, which only eager attention returns."""
AFTER_CALL = {"KVComposePress"}
"""Presses that compress once their context manager exits (every layer at once: KVCompose's
cross-layer allocation), not in ``compress`` after each layer's attention: the kept positions are
read around their ``compress_cache``. Their layers then hold different lengths, so the answer is
decoded with SDPA, which needs no mask over one query (an eager mask has layer 0's length)."""


def build_press(spec: dict):
    """A kvpress press from ``{"class": name, "kwargs": {...}}`` (nested presses allowed)."""
    kwargs = {key: build_press(value) if isinstance(value, dict) else value for key, value in spec["kwargs"].items()}
    return getattr(kvpress, spec["class"])(**kwargs)


def matched_positions(original: torch.Tensor, kept: torch.Tensor) -> list[list[int]]:
    """For each KV head, the indices in ``original`` ``[1, heads, n, d]`` of the rows of ``kept``
    ``[1, heads, k, d]``, sorted. Raises if a kept row has no identical original row."""
    out = []
    for head in range(original.shape[1]):
        same = (kept[0, head][:, None, :] == original[0, head][None, :, :]).all(-1)  # [k, n]
        if not bool(same.any(-1).all()):
            raise RuntimeError("a kept key matches no original key")
        out.append(sorted(int(i) for i in same.float().argmax(-1).tolist()))
    return out


def pattern_loader(pattern: dict):
    """A stand-in for DuoAttentionPress.load_attention_pattern (which downloads published patterns):
    the sink and recent sizes and head scores the job names."""
    import numpy as np

    return lambda model: (pattern["sink_size"], pattern["recent_size"], np.array(pattern["head_scores"], dtype=float))


def masked_out(model, layer: int, kept: list[list[int]]) -> list[list[int]]:
    """``kept`` less the positions a head-wise press masks in ``layer`` (``masked_key_indices``:
    DuoAttention, CriticalAdaKV, KVzip compress by masking keys rather than dropping them)."""
    indices = getattr(model.model.layers[layer].self_attn, "masked_key_indices", None)
    if indices is None:
        return kept
    batch, heads, positions = (index.tolist() for index in indices)
    masked = [set() for _ in kept]
    for b, h, p in zip(batch, heads, positions):
        if b == 0:
            masked[h].add(p)
    return [[p for p in head if p not in masked[h]] for h, head in enumerate(kept)]


def run_job(models: dict, job: dict, max_new_tokens: int, eos: set[int]) -> dict:
    """Compress one prompt with one press, decode greedily; the kept positions and the tokens."""
    press = build_press(job["press"])
    if "pattern" in job["press"]:
        press.load_attention_pattern = pattern_loader(job["press"]["pattern"])
    if job["ratio"] is not None:
        press.compression_ratio = job["ratio"]
    model = models["eager" if job["press"]["class"] in EAGER else "sdpa"]
    kept: dict[int, list[list[int]]] = {}
    if job["press"]["class"] in AFTER_CALL:
        compress_cache = press.compress_cache

        def recording_cache(model):
            layers = press.cache.layers
            before = [layer.keys[:, :, : press.context_len].clone() for layer in layers]
            compress_cache(model)
            kept.update({index: matched_positions(keys, layer.keys) for index, (keys, layer) in enumerate(zip(before, layers))})

        press.compress_cache = recording_cache
    else:
        inner = press.compress

        def recording(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = inner(module, hidden_states, keys, values, attentions, kwargs)
            kept[module.layer_idx] = matched_positions(keys, new_keys)
            return new_keys, new_values

        press.compress = recording
    ids = torch.tensor([job["ids"]])
    length = ids.shape[1]
    cache = DynamicCache()
    with torch.inference_mode():
        with press(model):
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        if job["press"]["class"] in AFTER_CALL:  # layers of different lengths: sdpa needs no mask over one query
            model = models["sdpa"]
        for step in range(max_new_tokens - 1):
            if tokens[-1] in eos:
                break
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[length + step]]),
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    everything = [list(range(length)) for _ in range(heads)]  # a press that only masks returns the keys it got
    return {
        "method": job["method"],
        "budget": job["budget"],
        "case": job["case"],
        "kept": [masked_out(model, layer, kept.get(layer, everything)) for layer in range(layers)],
        "tokens": tokens,
    }


def main() -> None:
    request = json.load(sys.stdin)
    torch.set_num_threads(int(request.get("threads", 1)))
    transformers.utils.logging.disable_progress_bar()
    models = {}
    for attn in ("sdpa", "eager"):
        models[attn] = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float32, attn_implementation=attn).eval()
    print(
        json.dumps({"versions": {"kvpress": _version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__}}),
        flush=True,
    )
    eos = set(request["eos"])
    for job in request["jobs"]:
        try:
            result = run_job(models, job, int(request["max_new_tokens"]), eos)
        except Exception as exc:  # noqa: BLE001 - one failing press is reported, the rest still run
            result = {"method": job["method"], "budget": job["budget"], "case": job["case"], "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
