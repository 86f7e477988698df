"""benchmarks/serve_bench.py runs end to end at tiny sizes (a smoke test; the figures mean nothing),
and its Engine replay loop drives the Engine API as specified (checked on a stand-in Engine
until ``kvlib.Engine`` exists)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import kvlib

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", BENCHMARKS / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StandInEngine:
    """The Engine API serve_systems codes against, served one greedy token per running request per
    step by full forwards without a cache (slow, exact; tiny models only)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec=None,
        *,
        max_batch_tokens: int = 256,
        page_size: int = 16,
        prefix_cache: bool = True,
        read_cache: bool = False,
    ) -> None:
        self.model, self.running, self.steps = model, {}, 0

    def add_request(self, prompt_ids: list[int], *, max_new_tokens: int = 32, do_sample: bool = False, eos_token_id=None) -> int:
        rid = len(self.running) + 1000
        self.running[rid] = (list(prompt_ids), [], max_new_tokens)
        return rid

    @property
    def has_unfinished(self) -> bool:
        return any(len(out) < wanted for _, out, wanted in self.running.values())

    def step(self) -> dict[int, list[int]]:
        self.steps += 1
        produced = {}
        with torch.inference_mode():
            for rid, (prompt, out, wanted) in self.running.items():
                if len(out) < wanted:
                    logits = self.model(input_ids=torch.tensor([prompt + out])).logits
                    out.append(int(logits[0, -1].argmax()))
                    produced[rid] = [out[-1]]
        return produced

    def stats(self) -> dict:
        return {"prefix_hit_rate": 0.25, "preemptions": 0, "pages_in_use": 0, "steps": self.steps}

    def memory_report(self) -> dict:
        return {"by_component": {"pages": 0, "read_cache": 0}, "peak_pages_bytes": 0, "peak_workspace_bytes": 0}


def test_serve_bench_quick_runs_the_baselines(tmp_path: Path) -> None:
    systems = "engine,padded,generate_batch" if hasattr(kvlib, "Engine") else "padded,generate_batch"
    result = _load_bench().run(["--quick", "--systems", systems, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_bench.json").read_text())
    assert list(saved["systems"]) == systems.split(",")
    for figures in saved["systems"].values():
        assert figures["output_tokens"] == saved["trace"]["output_tokens"]
        assert figures["tokens_per_s"] > 0 and 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
    assert saved["agreement"]["padded vs generate_batch"]["requests"] == saved["trace"]["requests"] == 6
    assert result["agreement"] == saved["agreement"]
    report = (tmp_path / "serve_bench.md").read_text()
    assert "| padded |" in report and "| generate_batch |" in report and str(tmp_path) not in report


def test_engine_replay_feeds_arrivals_and_reports_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(kvlib, "Engine"):
        monkeypatch.setattr(kvlib, "Engine", StandInEngine, raising=False)
    bench = _load_bench()
    result = bench.run(["--quick", "--systems", "engine,generate_batch", "--out", str(tmp_path)])
    engine = result["systems"]["engine"]
    assert engine["output_tokens"] == result["trace"]["output_tokens"] and 0 <= engine["stats"]["prefix_hit_rate"] <= 1
    assert result["agreement"]["engine vs generate_batch"]["requests_identical"] == 6
    assert result["ratios"]["engine/generate_batch"] == pytest.approx(
        engine["tokens_per_s"] / result["systems"]["generate_batch"]["tokens_per_s"]
    )
    assert "engine/generate_batch" in (tmp_path / "serve_bench.md").read_text()
    assert set(engine["memory"]) == {"peak_by_component", "peak_pages_bytes", "peak_workspace_bytes"}
    if kvlib.Engine is not StandInEngine:
        assert engine["memory"]["peak_by_component"]["pages"] > 0 and engine["memory"]["peak_by_component"]["read_cache"] == 0
        assert engine["memory"]["peak_workspace_bytes"] > 0 and "Engine memory" in (tmp_path / "serve_bench.md").read_text()


def test_engine_replay_adds_requests_only_once_they_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvlib, "Engine", StandInEngine, raising=False)
    bench = _load_bench()  # also puts benchmarks/ on sys.path
    systems, trace = sys.modules["serve_systems"], sys.modules["serve_trace"]
    model = bench.random_llama(bench.TINY_LLAMA)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # first calls' set-up outside the replay: its steps take milliseconds
    requests = [trace.Request(arrival_s, [1, 2, 3], 3, "system", i) for i, arrival_s in enumerate((0.0, 0.05, 1.0))]
    replay = systems.replay_engine(model, requests, systems.ServeSettings())
    assert [len(t) for t in replay.tokens] == [3, 3, 3] and replay.tokens[0] == replay.tokens[2]
    for r, times in zip(requests, replay.times_s):
        assert r.arrival_s <= times[0] and times == sorted(times)
    assert replay.extra["stats"]["steps"] >= 6  # the last request arrived after the first two had finished


def test_bad_flags_name_what_is_valid() -> None:
    bench = _load_bench()
    with pytest.raises(SystemExit):
        bench.run(["--quick", "--systems", "padded,vllm"])
    with pytest.raises(SystemExit):
        bench.run(["--quick", "--batch-size", "0"])
    with pytest.raises(ValueError, match="--batch-size must be at least 1, got 0"):
        sys.modules["serve_systems"].ServeSettings(batch_size=0)
    with pytest.raises(ValueError, match="kind one of system, chat, rag"):
        bench.parse_weights("system=1,docs=2")
    with pytest.raises(ValueError, match="choose one or more of engine, padded, generate_batch"):
        bench.parse_systems("padded,vllm")


def test_kvlib_bench_runs_serve_bench_but_not_its_helper_modules() -> None:
    from kvlib import cli

    scripts = {p.stem: p.read_text() for p in BENCHMARKS.glob("*.py") if p.stem not in cli.BENCH_HELPERS}
    assert "serve_bench" in scripts
    assert all('if __name__ == "__main__":' in text for text in scripts.values()), sorted(
        name for name, text in scripts.items() if 'if __name__ == "__main__":' not in text
    )


def test_fixed_memory_mode_compares_concurrency_and_kl_at_one_budget(tmp_path: Path) -> None:
    result = _load_bench().run(["--quick", "--fixed-memory-mb", "0.05", "--codecs", "kivi(bits=4)", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_bench_fixed_memory.json").read_text())
    exact, kivi = saved["engines"]["exact"], saved["engines"]["kivi(bits=4)"]
    assert exact["output_tokens"] == kivi["output_tokens"] == saved["trace"]["requests"] * saved["trace"]["new_tokens"]
    assert exact["open_page_cost"] == 1 < kivi["open_page_cost"] and exact["pages_per_layer"] < kivi["pages_per_layer"]
    assert 1 <= exact["max_concurrent"] < kivi["max_concurrent"]  # 12 raw pages per layer hold two of the six requests
    assert kivi["max_concurrent_ratio"] == kivi["max_concurrent"] / exact["max_concurrent"]
    assert 0 <= kivi["kl_mean_nats"] <= kivi["kl_max_nats"] < 0.1 and 1 <= kivi["kl_steps"] <= kivi["output_steps"]
    assert result["engines"]["exact"] == exact
    report = (tmp_path / "serve_bench_fixed_memory.md").read_text()
    assert "| kivi(bits=4) |" in report and "--fixed-memory-mb 0.05" in report and str(tmp_path) not in report


def test_kl_nats_matches_a_hand_computation() -> None:
    _load_bench()
    fixed = sys.modules["serve_fixed_memory"]
    reference = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]).log()
    logits = torch.tensor([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]]).log() + 3.0  # unnormalized: log-softmax removes the shift
    by_hand = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(1.0)
    assert fixed.kl_nats(reference, logits).tolist() == pytest.approx([by_hand, 0.0], abs=1e-6)


def test_fixed_memory_kl_compares_only_steps_whose_context_matches_the_exact_run() -> None:
    _load_bench()
    fixed = sys.modules["serve_fixed_memory"]
    logp = [torch.log_softmax(torch.randn(5, generator=torch.Generator().manual_seed(s)), -1) for s in range(3)]
    reference = fixed.CapacityRun([[1, 2, 3]], [logp])
    run = fixed.CapacityRun([[]])
    for step, token in enumerate([1, 4, 3]):  # the codec run disagrees at its second token
        fixed._record(run, reference, 0, logp[step] + 1.0)
        run.tokens[0].append(token)
    assert run.kl == pytest.approx([0.0, 0.0], abs=1e-6)  # steps 0 and 1 compared (same contexts); step 2's context differs


def test_fixed_memory_exact_run_records_the_rows_of_its_own_greedy_tokens() -> None:
    bench = _load_bench()
    fixed = sys.modules["serve_fixed_memory"]
    model = bench.random_llama(bench.TINY_LLAMA)
    requests = fixed.saturating_trace(fixed.random_prompts(3, sys.modules["serve_trace"].Lengths(20, 40), 512, seed=0), 4)
    run = fixed.run_engine(model, requests, None, fixed.FixedMemorySettings(2**20, codecs=()))
    assert [len(t) for t in run.tokens] == [4, 4, 4]
    assert [[int(row.argmax()) for row in rows] for rows in run.logp] == run.tokens
    with pytest.raises(ValueError, match="quantization codecs"):
        fixed.FixedMemorySettings(2**20, codecs=("snapkv",))


@pytest.mark.slow
def test_features_mode_runs_each_feature_on_and_off(tmp_path: Path) -> None:
    result = _load_bench().run(["--features", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_bench_features.json").read_text())
    assert saved["grouping"] == result["grouping"] and set(saved["grouping"]["variants"]) == {"grouped", "ungrouped"}
    assert set(saved["forecast"]["variants"]) == {"forecast", "reserve"}
    assert saved["grouping"]["outputs_equal"] and saved["forecast"]["outputs_equal"]
    grouping = saved["grouping"]["variants"]
    assert grouping["grouped"]["prompt_tokens_computed"] <= grouping["ungrouped"]["prompt_tokens_computed"]
    shared = saved["shared_prefix"]
    assert shared["outputs_equal"] and all(v["kv_read_as_expected"] for v in shared["variants"].values())
    assert shared["variants"]["on"]["kv_read_mib_per_step"] < shared["variants"]["off"]["kv_read_mib_per_step"]
    assert set(saved["speculation"]) == {"edits", "json", "mixed"} and all(w["outputs_equal"] for w in saved["speculation"].values())
    report = (tmp_path / "serve_bench_features.md").read_text()
    assert "| grouped |" in report and "| forecast |" in report and str(tmp_path) not in report
    assert "| on |" in report and "| edits |" in report
