"""quickstart.py: the README's two commands (its set-up runs for real in CI, on a fresh clone)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unknown_command_prints_usage_and_exits_2_before_any_set_up(capsys, monkeypatch) -> None:
    quickstart = load_quickstart()
    monkeypatch.setattr(quickstart, "ensure_environment", lambda: pytest.fail("set-up ran"))
    assert quickstart.main([]) == 2
    assert quickstart.main(["bench"]) == 2
    assert "usage: python3 quickstart.py {compare|test}" in capsys.readouterr().err


def test_the_torch_requirement_follows_the_machine_and_the_override(monkeypatch) -> None:
    quickstart = load_quickstart()
    monkeypatch.delenv("KVLIB_TORCH", raising=False)
    monkeypatch.setattr(quickstart.shutil, "which", lambda name: None)
    assert quickstart._torch_requirement() == "torch==2.13.0"
    monkeypatch.setattr(quickstart.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert quickstart._torch_requirement() == "torch"
    monkeypatch.setenv("KVLIB_TORCH", "torch==2.9.1")
    assert quickstart._torch_requirement() == "torch==2.9.1"


def test_the_stamp_changes_with_what_the_environment_is_built_from() -> None:
    quickstart = load_quickstart()
    base = quickstart._stamp("torch==2.13.0", "")
    assert base == quickstart._stamp("torch==2.13.0", "")
    assert base != quickstart._stamp("torch", "")
    assert base != quickstart._stamp("torch==2.13.0", "5.18.0")


def test_an_existing_environment_with_a_matching_stamp_is_reused(tmp_path, monkeypatch) -> None:
    quickstart = load_quickstart()
    monkeypatch.setattr(quickstart, "ROOT", ROOT)
    monkeypatch.setenv("KVLIB_VENV", str(tmp_path / "env"))
    monkeypatch.delenv("KVLIB_TRANSFORMERS", raising=False)
    monkeypatch.setenv("KVLIB_TORCH", "torch==2.13.0")
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "kvlib-setup.stamp").write_text(quickstart._stamp("torch==2.13.0", ""))
    monkeypatch.setattr(quickstart, "_run", lambda command: pytest.fail(f"set-up ran {command}"))
    assert quickstart.ensure_environment().parent.parent == tmp_path / "env"


def test_the_suite_runs_on_every_core_unless_the_caller_chooses() -> None:
    quickstart = load_quickstart()
    assert quickstart.pytest_arguments([], cores=2) == ["-n", "2"]
    assert quickstart.pytest_arguments(["-m", "smoke", "-x"], cores=16) == ["-n", "16", "-m", "smoke", "-x"]
    assert quickstart.pytest_arguments(["-m", "smoke"], cores=1) == ["-m", "smoke"]  # one core: no workers to start
    for own in (["-n", "0"], ["-n4"], ["-nauto"], ["--numprocesses", "3"], ["--numprocesses=3"], ["-p", "no:xdist"], ["-pno:xdist"]):
        assert quickstart.pytest_arguments([*own, "-x"], cores=2) == [*own, "-x"]
    assert quickstart.pytest_arguments(["-p", "no:cacheprovider"], cores=2) == ["-n", "2", "-p", "no:cacheprovider"]


def test_the_test_command_passes_the_workers_to_pytest(monkeypatch) -> None:
    quickstart = load_quickstart()
    monkeypatch.setattr(quickstart, "ensure_environment", lambda: Path("/venv/bin/python"))
    monkeypatch.setattr(quickstart, "usable_cores", lambda: 2)
    ran = []
    monkeypatch.setattr(quickstart.subprocess, "run", lambda command, cwd: ran.append(command) or subprocess.CompletedProcess(command, 3))
    assert quickstart.main(["test", "-m", "smoke"]) == 3  # pytest's exit status
    assert ran == [["/venv/bin/python", "-m", "pytest", "-n", "2", "-m", "smoke"]]


def test_usable_cores_are_the_cores_this_process_may_run_on() -> None:
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert load_quickstart().usable_cores() == expected >= 1
