"""benchmarks/speculate_bench.py runs end to end at tiny sizes (a smoke test; the figures mean
nothing): every workload served with speculation on and off, the same greedy outputs, and drafts
accepted on the repetitive workloads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_run_reports_both_variants_with_equal_outputs(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("speculate_bench", BENCHMARKS / "speculate_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(["--quick", "--threads", "1", "--out", str(tmp_path)])
    assert set(result["workloads"]) == {"edits", "json", "mixed"}
    for row in result["workloads"].values():
        assert row["outputs_equal"] and set(row["variants"]) == {"off", "suffix"}
        assert row["variants"]["off"]["verifications"] == 0
    assert result["workloads"]["json"]["variants"]["suffix"]["accepted_per_verification"] > 0
    assert json.loads((tmp_path / "speculate_bench_quick.json").read_text())["workloads"].keys() == result["workloads"].keys()
    assert "| edits |" in (tmp_path / "speculate_bench_quick.md").read_text()
