"""Tests for kvlib.params: coercion and description of typed policy parameters."""

import typing
from typing import Any, Literal, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib.errors import SpecError
from kvlib.params import Seed, coerce, describe
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.policy import Budget, Eviction


def ok(annotation, value):
    return coerce("owner", "param", annotation, value)


def rejected(annotation, value) -> str:
    with pytest.raises(SpecError) as info:
        ok(annotation, value)
    return str(info.value)


# -- describe ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "annotation, text",
    [
        (int, "int"),
        (float, "float"),
        (bool, "bool"),
        (str, "str"),
        (type(None), "None"),
        (Literal["a", "b"], "'a' | 'b'"),
        (Literal[1, 2], "1 | 2"),
        (int | None, "int | None"),
        (Optional[float], "float | None"),  # noqa: UP045 - the old spelling is described too
        (typing.Union[int, str], "int | str"),  # noqa: UP007 - the old spelling is described too
        (tuple[int, ...], "tuple[int, ...]"),
        (tuple[float, ...] | None, "tuple[float, ...] | None"),
        (Literal["x"] | None, "'x' | None"),
        (Eviction, "Eviction"),
        (Eviction | None, "Eviction | None"),
    ],
)
def test_describe(annotation, text):
    assert describe(annotation) == text


# -- int / float / bool / str -----------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, -7, 2**80])
def test_int_accepts_ints(value):
    result = ok(int, value)
    assert result == value
    assert type(result) is int


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, "3", None, (1,)])
def test_int_rejects_non_ints_and_bool(value):
    message = rejected(int, value)
    assert "must be int" in message
    assert f"got {value!r} ({type(value).__name__})" in message


@given(st.integers())
def test_int_identity_property(value):
    assert ok(int, value) == value


@pytest.mark.parametrize("value, expected", [(2, 2.0), (0, 0.0), (-3, -3.0), (2.5, 2.5)])
def test_float_accepts_and_widens_ints(value, expected):
    result = ok(float, value)
    assert result == expected
    assert type(result) is float


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_float_rejects_non_finite(value):
    assert "must be finite" in rejected(float, value)


@given(st.integers(min_value=-(2**53), max_value=2**53))
def test_float_widens_ints_property(value):
    result = ok(float, value)
    assert type(result) is float
    assert result == value


@pytest.mark.parametrize("value", [True, False, "2.5", None, [1.0]])
def test_float_rejects_bool_and_non_numbers(value):
    assert "must be float" in rejected(float, value)


@pytest.mark.parametrize("value", [True, False])
def test_bool_accepts_bools(value):
    assert ok(bool, value) is value


@pytest.mark.parametrize("value", [0, 1, "True", "false", None, 1.0])
def test_bool_rejects_non_bools(value):
    assert "must be bool" in rejected(bool, value)


def test_str():
    assert ok(str, "prefix") == "prefix"
    assert ok(str, "") == ""
    for value in (1, None, b"bytes", ["a"]):
        assert "must be str" in rejected(str, value)


# -- Literal / Optional / tuple -----------------------------------------------------------


def test_literal_strings():
    assert ok(Literal["mean", "max"], "max") == "max"
    message = rejected(Literal["mean", "max"], "min")
    assert "must be 'mean' | 'max'" in message
    assert "got 'min' (str)" in message


def test_literal_ints_reject_bool_and_other_values():
    assert ok(Literal[1, 2, 4], 4) == 4
    assert "must be 1 | 2 | 4" in rejected(Literal[1, 2, 4], 3)
    assert "must be 1 | 2 | 4" in rejected(Literal[1, 2, 4], True)  # True == 1, but it is a bool


def test_literal_ints_reject_equal_float():
    rejected(Literal[1, 2, 4], 2.0)


def test_literal_with_bool_members_accepts_bools():
    assert ok(Literal["auto", True, False], True) is True


@pytest.mark.parametrize("value, expected", [(None, None), (3, 3)])
def test_optional_int_accepts(value, expected):
    assert ok(int | None, value) == expected
    assert ok(Optional[int], value) == expected  # noqa: UP045 - the old spelling is coerced too


@pytest.mark.parametrize("value", ["3", 2.5, True])
def test_optional_int_rejects(value):
    message = rejected(int | None, value)
    assert "must be int | None" in message


def test_optional_float_widens():
    result = ok(float | None, 3)
    assert result == 3.0 and type(result) is float


def test_none_type():
    assert ok(type(None), None) is None
    assert "must be None" in rejected(type(None), 0)


@pytest.mark.parametrize("value", [[1, 2, 3], (1, 2, 3)])
def test_tuple_accepts_lists_and_tuples(value):
    result = ok(tuple[int, ...], value)
    assert result == (1, 2, 3)
    assert type(result) is tuple


def test_tuple_empty_and_items_coerced():
    assert ok(tuple[int, ...], []) == ()
    result = ok(tuple[float, ...], [1, 2.5])
    assert result == (1.0, 2.5)
    assert all(type(x) is float for x in result)


@pytest.mark.parametrize("value", [[1, "2"], [1, True], (1.5,), "12", 12, None, {1, 2}])
def test_tuple_rejects_wrong_items_and_non_sequences(value):
    message = rejected(tuple[int, ...], value)
    assert "must be tuple[int, ...]" in message


@given(st.lists(st.integers(), max_size=8))
def test_tuple_from_list_property(values):
    assert ok(tuple[int, ...], values) == tuple(values)


def test_optional_tuple():
    assert ok(tuple[int, ...] | None, None) is None
    assert ok(tuple[int, ...] | None, [4]) == (4,)


def test_fixed_length_tuple_is_not_silently_homogeneous():
    try:
        assert ok(tuple[int, str], (1, "a")) == (1, "a")
    except SpecError as exc:
        assert "unsupported" in str(exc)


# -- Any / policy annotations / unsupported -----------------------------------------------


def test_any_passes_through():
    marker = object()
    assert ok(Any, marker) is marker


def test_policy_annotation_accepts_object_and_spec_string():
    obj = StreamingLLM(sinks=1)
    assert ok(Eviction, obj) is obj
    assert ok(Eviction, "streaming_llm(sinks=1)") == obj
    assert ok(Eviction | None, "streaming_llm") == StreamingLLM()
    assert ok(Eviction | None, None) is None


def test_policy_annotation_rejects_wrong_kind_and_bad_strings():
    message = rejected(Budget, StreamingLLM())
    assert "parameter 'param' must be Budget" in message
    assert "expected a budget policy" in message
    assert "unknown policy 'nope'" in rejected(Eviction, "nope")
    assert "expected exactly one policy" in rejected(Eviction, "streaming_llm+streaming_llm")
    assert "must be Eviction" in rejected(Eviction, 3)


@pytest.mark.parametrize("annotation", [list, dict[str, int], set[int], list[int], bytes, complex])
def test_unsupported_annotation(annotation):
    message = rejected(annotation, None)
    assert "unsupported parameter annotation" in message
    assert f"must be {describe(annotation)}" in message


def test_error_names_owner_parameter_and_type():
    with pytest.raises(SpecError) as info:
        coerce("snapkv", "window", int, "32")
    assert str(info.value) == "snapkv: parameter 'window' must be int, got '32' (str)"
    assert isinstance(info.value, ValueError)


def test_error_for_literal_names_valid_values():
    with pytest.raises(SpecError) as info:
        coerce("kivi", "bits", Literal[2, 4], 3)
    assert str(info.value) == "kivi: parameter 'bits' must be 2 | 4, got 3 (int)"


def test_seeds_are_ints_torch_and_numpy_take() -> None:
    assert ok(Seed, 0) == 0 and ok(Seed, 2**63 - 1) == 2**63 - 1
    for bad in (-1, 2**63, 2**80, "abc", 1.0, True, None):
        assert "parameter 'param' must be Seed" in rejected(Seed, bad)
