"""benchmarks/kvpress_parity.py's pure parts: overlaps, method names, arguments, the report. Needs
neither kvpress nor a model."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

import kvlib
from kvlib.spec import parse_spec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


parity = _load("kvpress_parity")


def test_jaccard_of_position_sets() -> None:
    assert parity.jaccard([1, 2, 3], [2, 3, 4]) == pytest.approx(0.5)
    assert parity.jaccard([5, 1], [1, 5]) == 1.0
    assert parity.jaccard([], []) == 1.0
    assert parity.jaccard([0], [1]) == 0.0
    overlaps = parity.kept_jaccard([[[0, 1], [2]], [[3], []]], [[[1, 0], [3]], [[3], []]])
    assert overlaps == [[1.0, 0.0], [1.0, 1.0]]
    with pytest.raises(ValueError):
        parity.kept_jaccard([[[0]]], [[[0], [1]]])


def test_every_method_maps_to_a_registered_kvlib_spec_and_a_press() -> None:
    assert list(parity.METHODS) == [
        "SnapKV",
        "TOVA",
        "KNorm",
        "StreamingLLM",
        "PyramidKV",
        "ExpectedAttention",
        "ObservedAttention",
        "LagKV",
        "KeyDiff",
        "ChunkKV",
        "CriticalAdaKV",
        "KVzip",
        "DuoAttention",
        "KVCompose",
    ]
    for name, method in parity.METHODS.items():
        spec = parse_spec(method.kvlib)
        assert spec.eviction is not None, name
        assert method.press["class"].endswith("Press")
    assert kvlib.make_cache  # the kvlib side builds caches through the public entry point


def test_arguments() -> None:
    args = parity.parse_args([])
    assert args.methods == list(parity.METHODS) and args.samples == 5 and args.budgets == [0.25, 0.1]
    assert args.threads == 1 and args.context == 1024
    args = parity.parse_args(["--methods", "snapkv,ChunkKV", "--samples", "2", "--budgets", "0.5"])
    assert args.methods == ["SnapKV", "ChunkKV"] and args.samples == 2 and args.budgets == [0.5]
    assert parity.parse_methods("all") == list(parity.METHODS)
    with pytest.raises(argparse.ArgumentTypeError):
        parity.parse_methods("nope")
    with pytest.raises(argparse.ArgumentTypeError):
        parity.parse_budgets("1.5")
    with pytest.raises(SystemExit):
        parity.parse_args(["--samples", "0"])


def test_kvpress_jobs_use_the_complementary_ratio() -> None:
    class Case:
        ids = (1, 2, 3)

    jobs = parity.kvpress_jobs(["KNorm"], [0.25, 0.1], [Case()])
    assert [(j["budget"], j["ratio"]) for j in jobs] == [(0.25, 0.75), (0.1, 0.9)]
    assert jobs[0]["press"] == {"class": "KnormPress", "kwargs": {}} and jobs[0]["ids"] == [1, 2, 3]


def test_duo_attention_jobs_carry_kvlibs_head_split() -> None:
    class Case:
        ids = tuple(range(1000))

    scores = [[0.1, 0.9], [0.5, 0.3]]
    job = parity.kvpress_jobs(["DuoAttention"], [0.5], [Case()], scores)[0]
    assert job["ratio"] is None  # the press fixes its own ratio from its heads
    # kvlib's DuoSplit: floor(4 * (500 - 80) / (1000 - 80)) = 1 retrieval head of 4, so 3/4 stream
    assert job["press"]["kwargs"] == {"head_compression_ratio": 0.75}
    assert job["press"]["pattern"] == {"sink_size": parity.DUO_SINKS, "recent_size": parity.DUO_RECENT, "head_scores": scores}


def test_report_rows_and_divergences(tmp_path: Path) -> None:
    cell = parity.Cell(
        "KNorm", 0.25, [1.0, 0.0], [1.0, 1.0], [[[1.0, 0.5]], [[0.5, 0.5]]], [2.0, 2.0], [2.0, 2.0], [0.5, 0.5], [0.25, 0.75]
    )
    row = cell.summary()
    assert row["kvlib_accuracy"] == 0.5 and row["kvpress_accuracy"] == 1.0
    assert row["jaccard"] == pytest.approx(0.625) and row["jaccard_min"] == 0.5 and row["jaccard_by_layer"] == [0.625]
    result = {
        "command": "python benchmarks/kvpress_parity.py --methods KNorm",
        "kvlib_revision": "abc",
        "versions": {"kvpress": "0.5.5", "transformers": "5.2.0", "torch": "2.13.0"},
        "kvlib_versions": {"transformers": "5.24.0", "torch": "2.13.0"},
        "samples": 2,
        "context": 1024,
        "seed": 0,
        "max_new_tokens": 32,
        "threads": 1,
        "seconds": 3.0,
        "methods": ["KNorm"],
        "rows": [row],
    }
    text = parity.render(result)
    assert "python benchmarks/kvpress_parity.py --methods KNorm" in text and "kvpress 0.5.5" in text
    assert "| KNorm | 0.25 | 0.50 | 1.00 | 0.625 (0.50) * | 2.0 / 2.0 | 0.50 / 0.50 |" in text
    assert "## Divergences" in text and "**KNorm**" in text
    parity.write_report(tmp_path, "kvpress_parity", text, result)
    assert json.loads((tmp_path / "kvpress_parity.json").read_text())["rows"][0]["method"] == "KNorm"
    assert (tmp_path / "kvpress_parity.md").read_text().startswith("# kvlib vs kvpress")
