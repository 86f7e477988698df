"""quickstart.py: the README's two commands (its set-up runs for real in CI, on a fresh clone)."""

from __future__ import annotations

import importlib.util
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
