"""benchmarks/tier_bench.py runs end to end at tiny sizes (a smoke test; the figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_tier_bench_quick_reports_throughput_and_restore(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("tier_bench", BENCHMARKS / "tier_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "tier_bench.json").read_text())
    assert saved["throughput"]["records"] == 4 and saved["throughput"]["read_mb_s"] > 0
    assert saved["restore"]["reused_tokens"] == 64 and saved["restore"]["disk"]["corrupt"] == 0
    quest = saved["quest"]
    assert [b["top_k"] for b in quest["budgets"]] == [1, 1, 2]  # 4 pages
    assert all(0 <= b[name]["agreement"] <= 1 and b[name]["kl"] >= 0 for b in quest["budgets"] for name in ("quest", "random_pages"))
    assert all(0 <= p["device_hit_rate"] <= 1 for p in quest["placement"].values())
    assert "| 2 (0.5) |" in (tmp_path / "tier_bench.md").read_text()
    assert saved["spill"]["by_tier"]["disk"] > 0 and saved["spill"]["ratio"] > 0
