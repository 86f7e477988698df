"""benchmarks/eviction_quality.py and eviction_speed.py run end to end at tiny sizes (smoke tests; the
figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

import kvlib

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a benchmark's quick run over every policy; .ci/run runs it after the suite
def test_eviction_quality_covers_every_registered_policy(tmp_path: Path) -> None:
    result = _load("eviction_quality").run(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "eviction_quality.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    budgets = saved["config"]["budget_values"]
    assert budgets == [12, 0.25]  # quick: int(0.25 * 48) tokens, and 0.25 as a float
    registered = kvlib.available_policies()["eviction"]
    full, *rows = saved["rows"]
    assert full["policy"] == "full" and full["agreement"] == 1.0 and abs(full["kl"]) < 1e-5
    assert sorted((r["policy"], r["budget"]) for r in rows) == sorted((s, b) for s in registered for b in budgets)
    for row in rows:
        assert "error" not in row, row
        assert 0.0 <= row["agreement"] <= 1.0 and 0.0 <= row["first_divergence"] <= 8
        assert row["kl"] > -1e-5 and math.isfinite(row["ppl"]) and row["ppl"] > 1.0
        assert 0.0 < row["pages_vs_full"] < 1.0 and 0.0 <= row["last16_kept"] <= 1.0
        assert len(row["kept_per_layer"]) == 4  # the default model's layers
    report = (tmp_path / "eviction_quality.md").read_text()
    assert "## Budget 12 tokens (25% of context)" in report and "## Budget 0.25 (float: prompt only)" in report
    assert all(f"| {name} |" in report for name in registered)
    assert str(tmp_path) not in report


@pytest.mark.slow  # a benchmark's quick run or a quality comparison: run with -m slow (CI's 15 minutes)
def test_eviction_speed_reports_ratios(tmp_path: Path) -> None:
    result = _load("eviction_speed").run(["--quick", "--policies", "streaming_llm", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "eviction_speed.json").read_text())
    assert saved["config"]["budget_tokens"] == 16 and saved["exact_tokens_match"]
    rows = saved["rows"]
    assert list(rows) == [
        "dynamic",
        "kvlib",
        "streaming_llm",
        "streaming_llm+mirror",
        "streaming_llm+interval",
        "streaming_llm+mirror+interval",
    ]
    assert rows["dynamic"]["bytes_vs_full_kv"] == 1.0 and rows["kvlib"]["speed_vs_kvlib_exact"] == 1.0
    for kind, row in rows.items():
        assert row["decode_tok_s"] > 0 and row["speed_vs_dynamic"] > 0 and row["next_step_total_bytes"] > 0
        if kind.startswith("streaming_llm"):
            assert row["peak_pages_vs_full"] < 1.0
            if "mirror" not in kind:  # a mirror is patched by slot-reuse evictions, so it stays held
                assert row["bytes_vs_full_kv"] < 0.5
    assert len(result["load_avg_1min_per_round"]) == 1
    report = (tmp_path / "eviction_speed.md").read_text()
    assert "| streaming_llm, budget 16, no read mirror |" in report and str(tmp_path) not in report
