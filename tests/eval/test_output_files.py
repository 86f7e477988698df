"""Output files in a folder another user can write (a shared ``--out``): links and files planted
under the names kvlib writes, or under the names it used to write through (``*.part``, a probe
named by the process id), are never written through; results replace them whole."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvlib.cli import check_out_folder
from kvlib.eval.output_files import check_writable, private_folder, replace_file
from kvlib.eval.report import write_results

PLANTED = ["compare.md", "compare.json", "compare.csv", "compare.md.part", "compare.json.part", "compare.csv.part"]


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    return path


def test_results_never_write_through_links_planted_in_a_shared_folder(tmp_path: Path) -> None:
    out, target = tmp_path / "out", victim(tmp_path)
    out.mkdir()
    for name in PLANTED:
        (out / name).symlink_to(target)
    paths = write_results([], out, {"note": "run"})
    assert target.read_bytes() == b"precious"
    assert all(not path.is_symlink() and path.is_file() for path in paths.values())
    assert json.loads(paths["json"].read_text()) and paths["markdown"].read_text()
    assert sorted(path.name for path in out.iterdir()) == sorted(PLANTED)  # the .part links are left alone, unused


def test_the_out_folder_check_opens_no_file_of_a_guessable_name(tmp_path: Path) -> None:
    out, target = tmp_path / "out", victim(tmp_path)
    out.mkdir()
    (out / f".kvlib-probe-{os.getpid()}").symlink_to(target)
    assert check_out_folder(str(out)) == out and target.read_bytes() == b"precious"
    assert [path.name for path in out.iterdir()] == [f".kvlib-probe-{os.getpid()}"]


def test_replace_file_writes_whole_files_and_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    assert replace_file(path, "first") == path and path.read_text() == "first"
    replace_file(path, b"second")
    assert path.read_bytes() == b"second" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
    with pytest.raises(OSError):
        replace_file(tmp_path / "missing" / "result.json", "x")
    check_writable(tmp_path)
    folder = private_folder(tmp_path / "model")
    assert folder.parent == tmp_path and stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.name.startswith(".model.")
