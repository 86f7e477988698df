"""benchmarks/record_bench.py runs end to end at tiny sizes (a smoke test; the figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_record_bench_quick_reports_bytes_and_speeds(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("record_bench", BENCHMARKS / "record_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "record_bench.json").read_text())
    assert saved["blocks"] == 8 and 0 < saved["ratio"] < 1.01
    assert {f["field"] for f in saved["fields"]} == {"key.codes", "key.scale", "key.minimum", "value.codes", "value.scale", "value.minimum"}
    assert all(s["median_mb_s"] > 0 for s in saved["speed"].values())
    assert "entropy-coded" in (tmp_path / "record_bench.md").read_text()
