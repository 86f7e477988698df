"""Variable tracking: the chain hidden in order, its names the answers, a solved example first."""

from __future__ import annotations

import re

import pytest

from kvlib.eval.ruler import VariableTrackingTask


def test_the_chain_is_hidden_in_order_and_its_names_are_the_answers(words):
    task = VariableTrackingTask(context=2048, samples=2)
    for case in task.cases(words):
        text = words.decode(list(case.ids))
        example, asked = text.split("Memorize and track")[1:3]
        value = re.search(r"assigned the value (\d{5}) in the text above", asked).group(1)
        names = case.answers
        assert len(names) == 5 and len(set(names)) == 5
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(4)]
        where = [asked.index(line) for line in lines]
        assert where == sorted(where)
        assert list(case.depths) == sorted(case.depths) and len(case.depths) == 5
        assert text.endswith(f"5 variables are assigned the value {value}, they are:")
        solved = re.search(r"they are: ((?:[A-Z]{5} ?){5})", example)
        assert solved is not None  # the example carries its answer


def test_several_chains_ask_the_first(words):
    case = VariableTrackingTask(context=2048, samples=1, chains=2, hops=2).cases(words)[0]
    asked = words.decode(list(case.ids)).split("Memorize and track")[2]
    assert asked.count("VAR ") == 2 * (1 + 2 * 2)  # 2 chains: a value line and 2 hop lines naming 2 variables each
    assert len(case.answers) == 3


def test_the_example_stays_within_a_quarter_of_a_small_context(words):
    task = VariableTrackingTask(context=1024, samples=1)
    rng = task.rng(0)
    example = task._example(rng, words)
    assert len(words.encode(example)) <= 256


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="hops"):
        VariableTrackingTask(hops=0)
