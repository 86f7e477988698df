"""``kvlib compare --ray`` on a real local Ray cluster: the same results as the serial run, and
bad addresses refused before any model work."""

import json
import os
import sys

import pytest

from kvlib import cli

if os.environ.get("CI") == "true":
    import ray  # CI installs the dev extras, kvlib[ray] among them: there a missing ray fails
else:
    ray = pytest.importorskip("ray")

SCORE_FIELDS = ("policy", "budget", "kv_bytes", "full_bytes", "kv_fraction", "error")


@pytest.fixture(scope="module")
def local_cluster():
    """One local Ray cluster of 2 CPUs for the module; ``--ray`` joins it (and leaves it running)."""
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def results(out):
    """compare.json's runs without the timings: what the serial and the Ray run must share."""
    runs = json.loads((out / "compare.json").read_text())["runs"]
    return [{**{k: run[k] for k in SCORE_FIELDS}, "tasks": run["tasks"]} for run in runs]


def compare_argv(out, *extra):
    return [
        "compare",
        "--model",
        "default",
        "--context",
        "128",
        "--samples",
        "1",
        "--tasks",
        "perplexity",
        "--policies",
        "streaming_llm,snapkv(window=8)",
        "--budgets",
        "0.25,0.5",
        "--threads",
        "1",
        "--speed-rounds",
        "2",
        "--speed-steps",
        "4",
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


@pytest.mark.slow  # a real Ray cluster (the suite's longest test); .ci/run runs it after the suite
def test_ray_gives_the_serial_results_tables_and_plots(local_cluster, tmp_path, capsys):
    assert cli.main(compare_argv(tmp_path / "serial")) == 0
    serial_table = capsys.readouterr().out
    assert cli.main(compare_argv(tmp_path / "ray", "--ray")) == 0
    ray_table = capsys.readouterr().out
    assert ray.is_initialized()  # the test's cluster was joined, not shut down
    assert results(tmp_path / "ray") == results(tmp_path / "serial")
    assert [(r["policy"], r["budget"]) for r in results(tmp_path / "ray")] == [
        ("full", None),
        ("streaming_llm", 0.25),
        ("streaming_llm", 0.5),
        ("snapkv(window=8)", 0.25),
        ("snapkv(window=8)", 0.5),
    ]
    record = json.loads((tmp_path / "ray" / "compare.json").read_text())
    assert record["complete"] and record["ray"] and record["threads"] == 1
    without_speed = [line.rsplit("|", 4)[0] for line in serial_table.splitlines() if line.startswith("|")]
    assert without_speed == [line.rsplit("|", 4)[0] for line in ray_table.splitlines() if line.startswith("|")]
    ray_runs = json.loads((tmp_path / "ray" / "compare.json").read_text())["runs"]
    for run in ray_runs:  # each speed unit: warmed up, then --speed-rounds rounds against the full cache in its worker
        assert run["decode_speed"]["rounds"] == 2 and len(run["decode_speed"]["vs_full"]) == 2
        assert run["decode_speed"]["low"] <= run["decode_tokens_per_s"] <= run["decode_speed"]["high"]
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == ["compare.csv", "compare.json", "compare.md", "perplexity.png"]


def never_load(name):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize(
    "address, message",
    [
        ("nonsense", "--ray takes HOST:PORT, ray://HOST:PORT or auto (nothing: a local cluster), got 'nonsense'"),
        ("127.0.0.1:99999", "--ray takes HOST:PORT"),
        ("127.0.0.1:1", "--ray '127.0.0.1:1': no Ray cluster answers there (Connection refused)"),
        ("ray://127.0.0.1:1", "--ray 'ray://127.0.0.1:1': no Ray cluster answers there"),
    ],
)
def test_a_bad_address_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, address, message):
    monkeypatch.setattr("kvlib.eval.load_model", never_load)
    assert cli.main(compare_argv(tmp_path, "--ray", address)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlib: error: {message}") and err.count("\n") == 1


def test_without_ray_installed_the_extra_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    monkeypatch.setattr("kvlib.eval.load_model", never_load)
    assert cli.main(compare_argv(tmp_path, "--ray")) == 2
    assert capsys.readouterr().err == "kvlib: error: --ray needs Ray: pip install 'kvlib[ray]'\n"


def test_a_configuration_stops_at_its_first_error_as_the_serial_loop_does():
    from kvlib.eval.compare_units import DecodeSpeed, Outcome
    from kvlib.eval.ray_compare import _assemble
    from kvlib.eval.task import TaskResult

    first = TaskResult("perplexity", "perplexity", 4.0, False, 10, 20)
    later = TaskResult("needle", "accuracy", 1.0, True, 10, 20)
    outcomes = [Outcome(result=first), Outcome(error="ValueError: bad"), Outcome(result=later), Outcome(speed=DecodeSpeed((9.0,)))]
    run = _assemble("snapkv", 0.5, outcomes)
    assert run.results == {"perplexity": first} and run.error == "ValueError: bad" and run.decode_tokens_per_s is None
