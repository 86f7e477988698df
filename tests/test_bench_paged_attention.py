"""benchmarks/bench_paged_attention.py runs end to end at a tiny size (a smoke test; the timings mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_paged_attention.py"


def test_bench_paged_attention_writes_its_report(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_paged_attention", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(["--quick", "--out", str(tmp_path)])
    assert [(row["model"], row["batch"], row["tokens"]) for row in result["rows"]] == [("smollm2", 1, 64), ("llama100m", 1, 64)]
    for row in result["rows"]:
        assert all(row[f"{case}_us"] > 0 for case in module.CASES)
        assert row["kv_bytes"] == 2 * row["tokens"] * module.SHAPES[row["model"]][1] * 64 * 4
    assert [(row["model"], row["tokens"], list(row["us"])) for row in result["coded"]] == [
        ("smollm2", 64, [module.FP32_PAGES, "kivi(bits=4)"]),
        ("llama100m", 64, [module.FP32_PAGES, "kivi(bits=4)"]),
    ]
    assert all(len(row["vs_fp32_pages"]["kivi(bits=4)"]) == 2 for row in result["coded"])
    saved = json.loads((tmp_path / "bench_paged_attention.json").read_text())
    assert saved["rows"] == result["rows"]
    report = (tmp_path / "bench_paged_attention.md").read_text()
    assert "| smollm2 | 1 | 64 |" in report and "| smollm2 | 1 | 64 | `kivi(bits=4)` |" in report
