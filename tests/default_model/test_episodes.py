"""Synthetic retrieval episodes (kvlib.default_model.episodes): exact length, answers where they belong."""

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.default_model.episodes import episode
from kvlib.eval.needle_format import QUESTION, needle_line

FILLER = np.frombuffer(("def f(x):\n    return x + 1\n\n" * 400).encode(), dtype=np.uint8)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.sampled_from([256, 300, 512, 1024]))
def test_episode_has_the_length_and_every_answer_is_a_copy_of_an_earlier_fact(seed, length):
    tokens, mask = episode(np.random.default_rng(seed), FILLER, length)
    assert tokens.shape == mask.shape == (length,) and mask.any()
    text = bytes(tokens).decode()
    answers = [bytes(tokens[s]).decode() for s in np.ma.clump_unmasked(np.ma.masked_array(mask, ~mask))]
    if QUESTION in text:  # passkey: the key appears twice in its needle line, then once answered
        key = answers[0]
        assert re.fullmatch(r"\d{4,7}", key) and text.count(needle_line(key)) == 1
        assert text.endswith(f"{QUESTION}{key}.\n")
    elif "# copy: " in text:
        assert text.count(f"# copy: {answers[0]}\n") == 2 and text.endswith(f"# copy: {answers[0]}\n")
    else:
        asked = re.findall(r"# recall: (\w+) = (\w+)\n", text)
        assert [v for _, v in asked] == answers
        for name, value in asked:
            assert f"# remember: {name} = {value}\n" in text
    for fact in re.finditer(r"# (remember|copy|The pass key)", text):
        assert fact.start() == 0 or text[fact.start() - 1] == "\n"  # facts start lines
