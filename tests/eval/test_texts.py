"""The evaluation text and its windows (kvlib.eval.texts)."""

import pytest

from kvlib.default_model.corpus import HOLDOUT, holdout_text, stdlib_dir, training_files
from kvlib.eval.texts import text_ids, windows


def test_default_text_is_the_held_out_modules_never_trained_on(tokenizer):
    root = stdlib_dir()
    assert {p.relative_to(root).as_posix() for p in training_files()}.isdisjoint(HOLDOUT)
    assert "class Fraction" in holdout_text() and len(text_ids(tokenizer)) > 100_000


def test_a_file_path_is_read(tmp_path, tokenizer):
    path = tmp_path / "t.txt"
    path.write_text("héllo")
    assert text_ids(tokenizer, str(path)) == tuple("héllo".encode())


def test_windows_are_seeded_spread_and_exact_length():
    ids = tuple(range(1000))
    first = windows(ids, 100, 4, seed=0)
    assert first == windows(ids, 100, 4, seed=0) and first != windows(ids, 100, 4, seed=1)
    assert all(len(w) == 100 and w == list(range(w[0], w[0] + 100)) for w in first)
    starts = [w[0] for w in first]
    assert starts == sorted(starts) and len(set(starts)) == 4


def test_too_short_a_text_is_refused():
    with pytest.raises(ValueError, match="fewer than the 50"):
        windows(tuple(range(10)), 50, 1, seed=0)
