"""benchmarks/shared_prefix_bench.py runs end to end at tiny sizes (a smoke test; the figures mean
nothing): both variants timed, the K/V bytes each decode step read equal to the expected counts
(the shared prompt once with sharing), and the same greedy outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_run_reads_the_shared_prompt_once_with_equal_outputs(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("shared_prefix_bench", BENCHMARKS / "shared_prefix_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(["--quick", "--threads", "1", "--out", str(tmp_path)])
    (case,) = result["cases"]
    assert case["outputs_equal"] and case["on"]["kv_read_as_expected"] and case["off"]["kv_read_as_expected"]
    assert case["on"]["kv_read_mib_per_step"] < case["off"]["kv_read_mib_per_step"]
    assert json.loads((tmp_path / "shared_prefix_bench_quick.json").read_text())["cases"][0]["rows"] == case["rows"]
    assert "| 3 | 64 |" in (tmp_path / "shared_prefix_bench_quick.md").read_text()
