"""Hand-made cases for the answer scorers (kvlib.eval.scoring)."""

import pytest

from kvlib.eval.scoring import (
    SCORERS,
    contains_match,
    exact_match,
    first_number,
    normalize,
    passkey_match,
    ruler_postprocess,
    string_match_all,
    string_match_part,
    token_f1,
)


def test_normalize_drops_case_punctuation_articles_and_spaces():
    assert normalize("  The  Cat, sat on a MAT! ") == "cat sat on mat"


@pytest.mark.parametrize(
    "prediction, key, expected",
    [
        ("48213.", "48213", True),
        (" 48213 is the pass key", "48213", True),
        ("482134", "48213", False),  # a longer number is wrong
        ("4821", "48213", False),
        ("the key is 48213", "48213", True),
        ("no number", "48213", False),
        ("12 48213", "48213", False),  # only the first number counts
    ],
)
def test_passkey_match(prediction, key, expected):
    assert passkey_match(prediction, key) is expected


def test_first_number():
    assert first_number("abc 0123 45") == "0123"
    assert first_number("none") is None


def test_exact_match_any_answer_after_normalisation():
    assert exact_match("The Eiffel Tower.", ["eiffel tower", "tour eiffel"]) == 1.0
    assert exact_match("Eiffel", ["eiffel tower"]) == 0.0


def test_contains_match_is_the_fraction_of_answers_found():
    assert contains_match("keys: alpha, beta", ["alpha", "beta"]) == 1.0
    assert contains_match("keys: alpha", ["alpha", "beta"]) == 0.5
    assert contains_match("anything", []) == 0.0


def test_token_f1_by_hand():
    # prediction tokens {paris, france}, truth {paris}: precision 1/2, recall 1 -> F1 2/3
    assert token_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    assert token_f1("Paris", ["London", "paris"]) == 1.0
    assert token_f1("Berlin", ["Paris"]) == 0.0
    # repeated words count once per occurrence in both (multiset intersection)
    assert token_f1("x y y", ["y y z"]) == pytest.approx(2 / 3)  # precision 2/3, recall 2/3
    assert token_f1("the y y", ["y y z"]) == pytest.approx(0.8)  # "the" is dropped: precision 1, recall 2/3


def test_ruler_string_match_all_is_the_case_insensitive_fraction_found():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert string_match_all("HOTEL, thin", ["hotel", "Thin", "bear"]) == pytest.approx(2 / 3)
    assert string_match_all("1234", ["123"]) == 1.0  # containment, as RULER scores it
    assert string_match_all("anything", []) == 0.0


def test_ruler_string_match_part_is_any_answer_found():
    assert string_match_part("It is Paris.", ["paris", "Lyon"]) == 1.0
    assert string_match_part("It is Rome.", ["paris", "lyon"]) == 0.0


def test_ruler_postprocess_turns_control_characters_into_newlines():
    assert ruler_postprocess("  a\tb\x00c \n") == "a\nb\nc"


def test_ruler_scorers_are_offered_to_jsonl_tasks():
    assert SCORERS["string_match_all"] is string_match_all and SCORERS["string_match_part"] is string_match_part
