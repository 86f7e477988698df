"""benchmarks/bench_generate.py runs end to end at a tiny size (a smoke test; the timings mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"


@pytest.mark.slow  # a benchmark's quick run; .ci/run runs it after the suite
def test_bench_generate_writes_its_report(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(["--quick", "--out", str(tmp_path)])
    config = result["config"]
    assert (config["models"], config["prompt_len"], config["new_tokens"], config["repeats"]) == ("default", 32, 8, 1)
    assert [(row["model"], row["batch"]) for row in result["rows"]] == [("default", 1), ("default", 2)]
    for row in result["rows"]:
        assert row["tokens_match"]
        assert row["attn_implementation"] == "kvlib_sdpa"
        assert row["dynamic"]["decode_tok_s"] > 0 and row["kvlib"]["decode_tok_s"] > 0 and row["ratio"] > 0
        assert row["dynamic"]["cache_bytes"] > 0 and row["kvlib"]["cache_bytes"] > 0
    assert result["all_tokens_match"]
    saved = json.loads((tmp_path / "bench_generate.json").read_text())
    assert saved["all_tokens_match"] and len(saved["rows"]) == 2
    report = (tmp_path / "bench_generate.md").read_text()
    assert "| default (0.82M params) | 1 |" in report and "Greedy tokens identical in every run: yes." in report
    assert str(tmp_path) not in report
