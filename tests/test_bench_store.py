"""benchmarks/bench_store.py runs end to end at a tiny size (a smoke test; it times nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_store.py"


def test_bench_store_writes_its_report(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_store", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--tokens", "20", "--layers", "2", "--heads", "2", "--head-dim", "4", "--steps", "2", "--page-size", "4"]
    result = module.run([*args, "--out", str(tmp_path)])
    names = [row["name"] for row in result["rows"]]
    assert names[0].startswith("torch.cat") and "paged store" in names
    assert result["rows"][0]["ratio_vs_cat"] == 1.0
    assert json.loads((tmp_path / "bench_store.json").read_text())["config"]["tokens"] == 20
    assert "| paged store |" in (tmp_path / "bench_store.md").read_text()
