"""Tests for the ``kvlib`` command line (kvlib.cli)."""

import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvlib import cli, registry
from kvlib.errors import SpecError
from kvlib.policy import KIND_BASES, Quantization

KINDS = ("eviction", "budget", "quantization", "lowrank", "reuse", "tiering", "recompute")


@dataclass
class MyTestCliQuant(Quantization):
    """Test-only quantization codec shown by kvlib list.

    Second docstring line, not shown.
    """

    bits: int = 2

    def layer_codecs(self, shapes):
        raise NotImplementedError("listed, never run")


def check_listing(out: str) -> None:
    lines = out.splitlines()
    kind_lines = [line for line in lines if not line.startswith(" ")]
    assert kind_lines == [f"{kind}:" for kind in KINDS]
    assert any(line.startswith("  streaming_llm: StreamingLLM (Xiao et al., 2023") for line in lines)
    assert "      parameters: sinks (int, default 4)" in lines


def test_list_prints_every_kind_and_streaming_llm(capsys):
    assert cli.main(["list"]) == 0
    captured = capsys.readouterr()
    check_listing(captured.out)
    assert captured.err == ""


def test_list_shows_empty_kinds_and_registered_plugins(capsys, monkeypatch):
    registry.available_policies()
    monkeypatch.setattr(registry, "_registry", {"streaming_llm": registry._registry["streaming_llm"]})
    registry.register("mytest_cli_quant")(MyTestCliQuant)

    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()

    assert "  mytest_cli_quant: Test-only quantization codec shown by kvlib list." in lines
    assert "      parameters: bits (int, default 2)" in lines
    assert "Second docstring line" not in "\n".join(lines)
    quant = lines.index("quantization:")
    assert lines[quant + 1] == "  mytest_cli_quant: Test-only quantization codec shown by kvlib list."
    for kind in ("budget", "lowrank", "reuse", "tiering"):
        assert lines[lines.index(f"{kind}:") + 1] == "  (none yet)"


def test_list_policies_matches_main_output(capsys):
    text = cli.list_policies()
    cli.main(["list"])
    assert capsys.readouterr().out == text + "\n"
    assert len(KIND_BASES) == len(KINDS)


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvlib")
    assert "list" in out
    assert "list registered policies by kind" in out


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "usage: kvlib" in capsys.readouterr().out


def test_unknown_command_is_one_line_and_exit_2(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlib: error: argument COMMAND: invalid choice: 'frobnicate'") and err.count("\n") == 1


def test_list_error_is_reported_with_exit_code_2(capsys, monkeypatch):
    def broken():
        raise SpecError("registry on fire")

    monkeypatch.setattr(cli, "list_policies", broken)
    assert cli.main(["list"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "kvlib: error: registry on fire\n"
    assert captured.out == ""


def test_module_entry_point_runs_list():
    result = subprocess.run([sys.executable, "-m", "kvlib.cli", "list"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    check_listing(result.stdout)


def test_summary_joins_the_first_paragraph_and_cuts_long_ones_at_a_word():
    assert cli.summary("One line\n    continued here.\n\n    Details.") == "One line continued here."
    long = cli.summary("word " * 100)
    assert len(long) <= cli.SUMMARY_CHARS and long.endswith("word...")
    assert cli.summary(None) == "" and cli.summary("   ") == ""


def test_bench_runs_each_script_with_quick_and_out_and_reports_failures(tmp_path, capsys):
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "provenance.py").write_text("raise SystemExit('a helper, never run')\n")
    (scripts / "good.py").write_text(
        "import sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "out.mkdir(exist_ok=True)\n(out / 'good.md').write_text(' '.join(sys.argv[1:]))\n"
    )
    (scripts / "bad.py").write_text("raise SystemExit(3)\n")
    out = tmp_path / "results"
    assert cli.main(["bench", "--dir", str(scripts), "--only", "good", "--quick", "--out", str(out)]) == 0
    assert (out / "good.md").read_text() == f"--quick --out {out}"
    assert cli.main(["bench", "--dir", str(scripts), "--out", str(out)]) == 1
    assert "kvlib bench: failed: bad" in capsys.readouterr().err


def test_the_out_folder_is_created_with_its_parents_and_left_as_it_was(tmp_path):
    out = cli.check_out_folder(str(tmp_path / "a" / "b"))
    assert out == tmp_path / "a" / "b" and out.is_dir() and list(out.iterdir()) == []
    (out / "earlier.json").write_text("{}")
    assert cli.check_out_folder(str(out)) == out and [p.name for p in out.iterdir()] == ["earlier.json"]


def test_bench_mistakes_are_one_line(tmp_path, capsys):
    assert cli.main(["bench", "--dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"kvlib: error: no benchmark scripts in {tmp_path}")
    (tmp_path / "a.py").write_text("")
    assert cli.main(["bench", "--dir", str(tmp_path), "--only", "b"]) == 2
    assert capsys.readouterr().err == "kvlib: error: unknown benchmarks ['b']; available: a\n"
