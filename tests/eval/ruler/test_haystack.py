"""Haystacks: essay sentences, and items inserted at the depths asked for."""

from __future__ import annotations

import random

import pytest

from kvlib.eval.ruler.haystack import DEPTHS, essay, insert_at_depths


def test_essay_sentences_are_prose_without_digits():
    sentences = essay(200, random.Random(0))
    assert len(sentences) == 200 and len(set(sentences)) > 150
    assert all(s[0].isupper() and s.endswith(".") and not any(c.isdigit() for c in s) for s in sentences)
    assert essay(5, random.Random(3)) == essay(5, random.Random(3))


@pytest.mark.parametrize("depth, before", [(0.0, 0), (0.25, 2), (0.5, 5), (0.99, 9), (1.0, 10)])
def test_an_item_lands_before_the_unit_at_its_depth(depth, before):
    units = [f"u{i}" for i in range(10)]
    out, landed = insert_at_depths(units, ["X"], [depth])
    assert out.index("X") == before and landed == [before / 10]
    assert [u for u in out if u != "X"] == units


def test_items_at_one_depth_keep_their_order():
    out, landed = insert_at_depths(["a", "b"], ["X", "Y", "Z"], [0.5, 0.5, 0.0])
    assert out == ["Z", "a", "X", "Y", "b"] and landed == [0.5, 0.5, 0.0]


def test_bad_depths_are_refused():
    with pytest.raises(ValueError, match="fractions"):
        insert_at_depths(["a"], ["X"], [1.5])
    with pytest.raises(ValueError, match="1 items but 2 depths"):
        insert_at_depths(["a"], ["X"], [0.1, 0.2])


def test_ruler_depths_are_forty_even_steps():
    assert len(DEPTHS) == 40 and DEPTHS[0] == 0.0 and DEPTHS[-1] == 1.0 and DEPTHS[20] == 0.51
