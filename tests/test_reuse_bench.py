"""benchmarks/reuse_bench.py runs end to end at tiny sizes (a smoke test; the figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_reuse_bench_quick_reports_ttft_index_cost_and_memory(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("reuse_bench", BENCHMARKS / "reuse_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "reuse_bench.json").read_text())
    assert saved["ttft"]["reused_tokens"] == 64 and saved["ttft"]["max_logit_diff"] < 1e-4
    assert saved["memory"]["ratio"] < 1.0 and saved["index"]["insert_us_per_token"] > 0
    assert "TTFT, cached prefix" in (tmp_path / "reuse_bench.md").read_text()
