"""benchmarks/codec_bench.py runs end to end at tiny sizes (a smoke test; the figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow  # a benchmark's quick run (the suite's codec tests check the codecs); .ci/run runs it after the suite
def test_codec_bench_quick_writes_every_section(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("codec_bench", BENCHMARKS / "codec_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "codec_bench.json").read_text())
    report = (tmp_path / "codec_bench.md").read_text()
    ratios = {row["codec"]: row["ratio"] for row in saved["bytes"]}
    assert ratios["kivi(bits=2)"]["64"] < ratios["kivi(bits=4)"]["64"] < ratios["int8"]["64"] < 0.55
    assert {row["dtype"] for row in saved["throughput"]} == {"float32", "float16"}
    assert all(row["encode_gb_s"] > 0 and row["decode_gb_s"] > 0 for row in saved["throughput"])
    assert [row["spec"] for row in saved["decode"]] == ["exact", "kivi(bits=4)"]
    quality = saved["quality"]
    assert quality["full"]["agreement"] == 1.0
    assert all("error" not in row for row in quality["codecs"] + quality["pairs"])
    assert any(row["spec"] == "streaming_llm+kivi(bits=4)" for row in quality["pairs"])
    for heading in ("Bytes per token", "throughput", "Decode speed", "Quality on the default model", "equal bytes"):
        assert heading in report
