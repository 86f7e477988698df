"""benchmarks/shadowkv_bench.py runs end to end at tiny sizes on SmolLM2 (a smoke test; the figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow  # a benchmark's quick run or a quality comparison: run with -m slow (CI's 15 minutes)
@pytest.mark.slow  # SmolLM2, numba compiles and 11 short runs: minutes on a loaded 2-core machine
def test_shadowkv_bench_quick_compares_quest_shadowkv_and_clusterkv_at_equal_device_bytes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("shadowkv_bench", BENCHMARKS / "shadowkv_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "shadowkv_bench.json").read_text())
    rows = {(row["budget"], row["name"]): row for row in saved["quality"]}
    assert set(rows) == {(budget, name) for budget in (8, 16) for name in ("quest", "shadowkv", "clusterkv", "random_pages")}
    assert all(0 <= row["agreement"] <= 1 and row["kl"] >= -1e-6 for row in rows.values())
    for budget in (8, 16):  # the same whole pages on the device, the rest on the host
        quest, shadow, cluster = (rows[(budget, name)]["by_tier"] for name in ("quest", "shadowkv", "clusterkv"))
        assert quest["device"] == shadow["device"] == cluster["device"] and quest["host"] == shadow["host"] == cluster["host"] > 0
    assert all(row["median"] > 0 for row in saved["speed"].values())
    assert "| 16 | `shadowkv(pages=12" in (tmp_path / "shadowkv_bench.md").read_text()
