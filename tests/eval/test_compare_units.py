"""The comparison's record of decode speed: built from the harness's timings, written and read back
(records from before the rounds included), shown with its spread; the speed run's options checked."""

from __future__ import annotations

import pytest

from kvlib.eval.compare_units import CompareRun, DecodeSpeed, check_speed
from kvlib.eval.decode_timing import Decoded, Spread, Timing
from kvlib.eval.report import csv_rows, runs_from_json, speed_cells, speed_note, spread_cell, to_json


def timing(tokens_per_s: list[float], warmup_wall: float = 2.0, walls: list[float] | None = None) -> Timing:
    runs = [Decoded(10, 10 / value, (25, 100)) for value in tokens_per_s]
    return Timing(Decoded(10, 1.0), warmup_wall, runs, walls or [0.5] * len(runs))


def test_a_speed_is_its_rounds_the_per_round_ratios_and_the_first_call():
    full, own = timing([100.0, 50.0, 80.0]), timing([50.0, 40.0, 20.0], warmup_wall=3.0, walls=[1.0, 0.5, 2.0])
    speed = DecodeSpeed.measured(own, full)
    assert speed.tokens_per_s == (50.0, 40.0, 20.0) and speed.vs_full == (0.5, 0.8, 0.25) and speed.first_call_s == 2.0
    assert speed.spread == Spread(40.0, 20.0, 50.0) and speed.ratio == Spread(0.5, 0.25, 0.8)
    assert DecodeSpeed.measured(Timing(), full) is None and DecodeSpeed((9.0,)).ratio is None
    run = CompareRun("snapkv", 0.25, speed=speed)
    assert run.decode_tokens_per_s == 40.0 and CompareRun("snapkv", 0.25).decode_tokens_per_s is None


def test_a_speed_reads_back_from_the_json_and_an_older_record_reads_as_one_run():
    speed = DecodeSpeed((50.0, 40.0, 20.0), (0.5, 0.8, 0.25), 2.0)
    run = CompareRun("snapkv", 0.25, speed=speed, kv_bytes=25, full_bytes=100)
    record = to_json([CompareRun("full", None, speed=DecodeSpeed((100.0, 50.0, 80.0), (1.0, 1.0, 1.0), 0.1)), run], {})
    entry = record["runs"][1]
    assert entry["decode_tokens_per_s"] == 40.0 and entry["decode_speed"]["rounds"] == 3
    assert (entry["decode_speed"]["low"], entry["decode_speed"]["high"]) == (20.0, 50.0)
    assert (entry["decode_speed"]["vs_full_median"], entry["decode_speed"]["vs_full_low"]) == (0.5, 0.25)
    assert runs_from_json(record)[1].speed == speed
    older = {**entry, "decode_tokens_per_s": 12.5}
    del older["decode_speed"]
    assert (
        DecodeSpeed.from_record(older) == DecodeSpeed((12.5,)) and DecodeSpeed.from_record({**older, "decode_tokens_per_s": None}) is None
    )
    row = csv_rows([run])[0]
    assert (row["decode_tokens_per_s"], row["decode_tokens_per_s_low"], row["decode_tokens_per_s_high"]) == (40.0, 20.0, 50.0)
    assert row["decode_rounds"] == "50;40;20" and (row["decode_vs_full"], row["first_call_s"]) == (0.5, 2.0)


def test_speed_cells_show_the_median_with_its_range():
    assert spread_cell([]) == "-" and spread_cell([12.5]) == "12.5 (1 run)" and spread_cell([1.0, 1.0, 1.0]) == "1"
    assert spread_cell([382.2, 371.0, 390.4]) == "382 [371, 390]"
    assert speed_cells(DecodeSpeed((50.0, 40.0, 20.0), (0.5, 0.8, 0.25), 2.0)) == ["40 [20, 50]", "0.50 [0.25, 0.80]", "2.00"]
    assert speed_cells(DecodeSpeed((12.5,))) == ["12.5 (1 run)", "-", "-"] and speed_cells(None) == ["-", "-", "-"]
    assert speed_cells(DecodeSpeed((1.0, 1.0), (1.0, 1.0), -0.001))[2] == "0.00"  # noise about nothing to compile


@pytest.mark.parametrize(
    ("context", "steps", "rounds", "message"),
    [
        (128, 0, 3, r"speed steps must be in \[1, 64\] \(half of the 128-token context\), got 0"),
        (128, 65, 3, r"speed steps must be in \[1, 64\]"),
        (128, 8, 0, "speed rounds must be >= 1, got 0"),
    ],
)
def test_the_speed_run_s_options_are_checked(context, steps, rounds, message):
    with pytest.raises(ValueError, match=message):
        check_speed(context, steps, rounds)
    check_speed(128, 64, 1)


def test_the_speed_note_says_how_many_rounds_and_what_an_older_figure_is():
    warmed = CompareRun("full", None, speed=DecodeSpeed((2.0, 3.0, 1.0), (1.0, 1.0, 1.0), 0.5))
    older = CompareRun("snapkv", 0.25, speed=DecodeSpeed((12.5,)))
    assert speed_note([warmed]).startswith("Decode tok/s: median [min, max] over 3 timed rounds") and "(1 run)" not in speed_note([warmed])
    assert speed_note([warmed, older]).endswith(
        "; (1 run): one speed run per configuration, recorded before speeds were warmed up and repeated."
    )
    assert speed_note([older, CompareRun("h2o", 0.25)]) == (
        "Decode tok/s: one speed run per configuration, recorded before speeds were warmed up and repeated."
    )
