"""benchmarks/remote_bench.py runs end to end at tiny sizes against a real server (a smoke test;
the timings mean nothing, the equalities do)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow  # a benchmark's quick run or a quality comparison: run with -m slow (CI's 15 minutes)
def test_remote_bench_quick(tmp_path: Path, redis_server) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("remote_bench", BENCHMARKS / "remote_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(["--quick", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "remote_bench.json").read_text())["rows"][0]
    assert row["restore"]["cached_tokens"] == [192, 192] and row["throughput"]["records"] == 12
    assert row["planted"]["planted"]["reused_tokens"] == 0 and row["planted"]["planted"]["hits"] == 0
    assert row["planted"]["altered"]["reused_tokens"] == 0 and row["planted"]["altered"]["hits"] == 0
    assert row["faults"]["finished"] == 40 and row["faults"]["outputs_equal"] and row["faults"]["remote"]["errors"] >= 1
    assert row["handover"]["received"] == 4 and row["handover"]["outputs_equal"]
    assert "Remote tier" in (tmp_path / "remote_bench.md").read_text()
