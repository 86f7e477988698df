"""The three systems the serving benchmark replays a trace on, each returning a ``Replay``:

- ``engine``: ``kvlib.Engine``; a request is added once its arrival time has passed (wall clock
  since the replay started) and ``step()`` runs while there is work; each token is timestamped
  when the step that made it returns.
- ``padded``: ``model.generate`` on static batches of ``batch_size`` requests in arrival order,
  left-padded; a batch starts when its last member has arrived and the previous batch returned.
  A streamer timestamps every decoding step, so a member's n-th token is timed at step n (a
  member asking fewer tokens than the batch's longest is cut at its own length).
- ``generate_batch``: transformers' continuous batching manager (what ``model.generate_batch``
  runs), started once; each request is added at its arrival time (``add_request``) and its tokens
  are timestamped by the manager's own generation thread (``record_timestamps``).

Every system decodes greedily and ignores EOS (the benchmark model has none; transformers' manager
is given ``eos_token_id=-1``), so each request gets exactly its ``max_new_tokens``. All times are
``time.perf_counter`` seconds since the replay started."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from serve_metrics import Replay
from serve_trace import Request
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

import kvlib

SYSTEMS = ("engine", "padded", "generate_batch")
PAD_TOKEN_ID = 0
"""Left padding for the static batches (masked out, so its value does not matter)."""


@dataclass(frozen=True)
class ServeSettings:
    """What the systems are given. ``max_batch_tokens`` (tokens per forward pass) and
    ``page_size`` (tokens per KV page) go to the Engine and to transformers' manager alike;
    ``batch_size`` (requests) to the padded baseline; ``engine_read_cache`` to the Engine (keep
    a dense read mirror of the decode group instead of attending over its pages)."""

    max_batch_tokens: int = 256
    page_size: int = 16
    batch_size: int = 8
    engine_read_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "page_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


def replay(system: str, model: torch.nn.Module, requests: list[Request], settings: ServeSettings) -> Replay:
    """Run ``requests`` (in arrival order) through ``system``, one of ``SYSTEMS``."""
    if system == "engine":
        return replay_engine(model, requests, settings)
    if system == "padded":
        return replay_padded(model, requests, settings)
    if system == "generate_batch":
        return replay_generate_batch(model, requests, settings)
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def _sleep_until(start: float, arrival_s: float) -> None:
    delay = start + arrival_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def replay_engine(model: torch.nn.Module, requests: list[Request], settings: ServeSettings) -> Replay:
    """A fresh ``kvlib.Engine`` (prefix cache on, empty) serving the requests as they arrive. Its
    ``extra`` holds ``engine.stats()`` and ``memory``: each component of ``memory_report()`` at
    its largest after any step (``peak_by_component``), and the report's peaks of pages and of
    the transient workspace."""
    engine = kvlib.Engine(
        model,
        max_batch_tokens=settings.max_batch_tokens,
        page_size=settings.page_size,
        prefix_cache=True,
        read_cache=settings.engine_read_cache,
    )
    peak: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in requests]
    times: list[list[float]] = [[] for _ in requests]
    index: dict[int, int] = {}
    start = time.perf_counter()
    added = 0
    while added < len(requests) or engine.has_unfinished:
        now = time.perf_counter() - start
        while added < len(requests) and requests[added].arrival_s <= now:
            r = requests[added]
            index[engine.add_request(r.prompt_ids, max_new_tokens=r.max_new_tokens, do_sample=False, eos_token_id=None)] = added
            added += 1
        if not engine.has_unfinished:
            _sleep_until(start, requests[added].arrival_s)
            continue
        produced = engine.step()
        stamp = time.perf_counter() - start
        for rid, new in produced.items():
            tokens[index[rid]].extend(new)
            times[index[rid]].extend([stamp] * len(new))
        for name, value in engine.memory_report()["by_component"].items():
            peak[name] = max(peak.get(name, 0), value)
    report = engine.memory_report()
    memory = {
        "peak_by_component": peak,
        "peak_pages_bytes": report["peak_pages_bytes"],
        "peak_workspace_bytes": report["peak_workspace_bytes"],
    }
    return Replay(tokens, times, {"stats": engine.stats(), "memory": memory})


class _StepClock(BaseStreamer):
    """Records when each decoding step's tokens reach the streamer (the first ``put`` is the
    prompt and is not a step)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.steps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.steps.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        """Nothing to flush: steps are recorded as they come."""


def replay_padded(model: torch.nn.Module, requests: list[Request], settings: ServeSettings) -> Replay:
    """Static left-padded batches of ``settings.batch_size`` through ``model.generate``."""
    model.set_attn_implementation("sdpa")
    tokens: list[list[int]] = []
    times: list[list[float]] = []
    start = time.perf_counter()
    for first in range(0, len(requests), settings.batch_size):
        batch = requests[first : first + settings.batch_size]
        _sleep_until(start, max(r.arrival_s for r in batch))
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        config = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in batch), do_sample=False, pad_token_id=PAD_TOKEN_ID)
        clock = _StepClock()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock)
        for row, r in enumerate(batch):
            tokens.append(out[row, width : width + r.max_new_tokens].tolist())
            times.append([t - start for t in clock.steps[: r.max_new_tokens]])
    return Replay(tokens, times, {"batch_size": settings.batch_size})


def replay_generate_batch(model: torch.nn.Module, requests: list[Request], settings: ServeSettings) -> Replay:
    """transformers' continuous batching manager (SDPA on the CPU, prefix block sharing allowed),
    its cache sized to hold every request of the trace at once (no request is ever evicted)."""
    model.set_attn_implementation("sdpa")
    pages = sum(-(-(len(r.prompt_ids) + r.max_new_tokens) // settings.page_size) for r in requests)
    cb_config = ContinuousBatchingConfig(
        page_size=settings.page_size,
        num_blocks=pages + 1,
        max_batch_tokens=settings.max_batch_tokens,
        allow_block_sharing=True,
        auto_switch_to_flash=False,
    )
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1), continuous_batching_config=cb_config
    )
    results = {}
    manager.start()
    start = time.perf_counter()
    try:
        for i, r in enumerate(requests):
            _sleep_until(start, r.arrival_s)
            manager.add_request(r.prompt_ids, request_id=str(i), max_new_tokens=r.max_new_tokens, eos_token_id=-1, record_timestamps=True)
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching stopped with {len(requests) - len(results)} requests unfinished")
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed request {result.request_id}: {result.error}")
                results[int(result.request_id)] = result
    finally:
        manager.stop(block=True)
        manager.destroy()
    ordered = [results[i] for i in range(len(requests))]
    return Replay([r.generated_tokens for r in ordered], [[t - start for t in r.timestamps] for r in ordered], {"num_blocks": pages + 1})
