"""benchmarks/bench_decode_caches.py runs end to end at a tiny size (a smoke test; the timings mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode_caches.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_decode_caches", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_caches_writes_its_table(tmp_path: Path) -> None:
    result = load_bench().run(["--quick", "--caches", "exact,streaming_llm_int25", "--contexts", "96", "--out", str(tmp_path)])
    [row] = result["rows"]
    exact, capped = row["caches"]["exact"], row["caches"]["streaming_llm_int25"]
    assert exact["tokens_match"] and exact["decode_vs_dynamic"] > 0
    assert capped["bytes_vs_dynamic"] < exact["bytes_vs_dynamic"]  # 24 of 100 tokens per head held
    assert exact["peak_workspace_bytes"] == 0  # the prefill attends over its own tensors
    assert len(json.loads((tmp_path / "bench_decode_caches.json").read_text())["rows"]) == 1
    report = (tmp_path / "bench_decode_caches.md").read_text()
    assert "| default | 96 | streaming_llm_int25 |" in report and str(tmp_path) not in report


def test_an_unknown_cache_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        load_bench().run(["--quick", "--caches", "exact,nope", "--out", str(tmp_path)])
