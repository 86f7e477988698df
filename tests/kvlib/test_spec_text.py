"""kvlib.spec_text: a list of specs splits on the commas outside parentheses."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvlib.spec_text import split_specs


def test_commas_inside_a_call_stay_with_their_spec() -> None:
    text = "snapkv, kv_bits(key_bits=2,value_bits=4),snapkv+kivi(bits=4, group=32) ,,"
    assert split_specs(text) == ["snapkv", "kv_bits(key_bits=2,value_bits=4)", "snapkv+kivi(bits=4, group=32)"]
    assert split_specs("") == [] and split_specs(" , ") == []


names = st.sampled_from(["snapkv", "h2o", "kivi(bits=4)", "kv_bits(key_bits=2,value_bits=4)", "snapkv+kivi(bits=2,group=16)"])


@given(st.lists(names, max_size=6))
def test_joining_with_commas_and_splitting_gives_the_specs_back(specs: list[str]) -> None:
    assert split_specs(",".join(specs)) == specs
