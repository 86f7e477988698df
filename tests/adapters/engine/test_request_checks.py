"""What one Engine request may ask for (kvlib.adapters.engine.request_checks): a request is refused
exactly when its prompt plus new tokens pass the model's context, or any value is of the wrong
type or out of range; a long prompt is refused before its ids are read."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib.adapters.engine.request_checks import REQUEST_OPTIONS, checked_request


@given(prompt=st.integers(1, 300), new=st.integers(1, 300), context=st.one_of(st.none(), st.integers(1, 512)))
def test_a_request_is_refused_exactly_when_it_passes_the_context(prompt: int, new: int, context: int | None) -> None:
    settings = REQUEST_OPTIONS | {"max_new_tokens": new, "eos_token_id": [2]}
    if context is not None and prompt + new > context:
        with pytest.raises(ValueError, match=f"a request of {prompt} prompt \\+ {new} new tokens is longer than the model's context"):
            checked_request([5] * prompt, settings, vocab=10, context=context)
    else:
        assert checked_request([5] * prompt, settings, vocab=10, context=context) == ([5] * prompt, frozenset({2}))


class Huge(Sequence):
    """A prompt of a billion tokens whose ids must never be read."""

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> int:
        raise AssertionError("the ids were read")


def test_a_long_prompt_is_refused_before_its_ids_are_read() -> None:
    with pytest.raises(ValueError, match=r"a request of 1000000000 prompt \+ 32 new tokens is longer than the limit of 1048576"):
        checked_request(Huge(), REQUEST_OPTIONS, vocab=10, context=None)
