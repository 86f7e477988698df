"""benchmarks/bench_coded_decode.py runs end to end at a tiny size (a smoke test; the timings mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_coded_decode.py"


@pytest.mark.slow  # a benchmark's quick run or a quality comparison: run with -m slow (CI's 15 minutes)
def test_bench_coded_decode_writes_its_report(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_coded_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.run(["--quick", "--specs", "kivi(bits=4);int8", "--out", str(tmp_path)])
    [row] = result["rows"]
    assert list(row["caches"]) == ["dynamic", "kvlib", "kivi(bits=4)", "int8"]
    for entry in row["caches"].values():
        assert entry["decode_tok_s"] > 0 and entry["cache_bytes"] > 0
    assert row["caches"]["kvlib"]["token_agreement_with_exact"] == 1.0
    assert row["caches"]["kivi(bits=4)"]["bytes_vs_dynamic"] < row["caches"]["int8"]["bytes_vs_dynamic"] < 1
    saved = json.loads((tmp_path / "bench_coded_decode.json").read_text())
    assert len(saved["rows"]) == 1
    report = (tmp_path / "bench_coded_decode.md").read_text()
    assert "| default (0.8M) | 1 | `kivi(bits=4)` |" in report and str(tmp_path) not in report


def test_a_bad_spec_fails_before_any_model_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_coded_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "load_bench_model", lambda name: pytest.fail(f"{name} loaded before the spec was checked"))
    with pytest.raises(ValueError, match="bits must be one of"):
        module.run(["--quick", "--specs", "kivi(bits=5)", "--out", str(tmp_path)])
