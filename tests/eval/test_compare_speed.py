"""The comparison's speed phase: a configuration's first compilation falls in its warm-up, never in
a timed round (checked with a policy whose scoring is a numba function compiled on its first call,
fresh in each test run); every configuration timed in every round with the full cache first; the
shared prefill's path recorded; a configuration that raises keeps its error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numba
import numpy as np
import pytest
import torch

from kvlib import registry
from kvlib.default_model import ByteTokenizer
from kvlib.eval.compare_speed import SPEED, measure_speeds
from kvlib.eval.compare_units import CompareRun, speed_run
from kvlib.eval.models import LoadedModel
from kvlib.eval.shared_compare import SHARED
from kvlib.policy import Eviction, LayerView
from tests.eval.conftest import tiny_byte_model

ROUNDS = 7
"""Enough rounds that two ranges of the same configuration's speed miss each other by chance only
about once in 1,700 runs (2 / C(14, 7)), whatever the machine's load: the rounds interleave."""


def fresh_jit_scorers():
    """Three numba functions, new objects each call, so the first call of each compiles (about a
    second in all on a quiet CPU, more under load): recency scores ``[.., slots]`` from positions."""

    def make(power: float):
        @numba.njit
        def ranked(positions):
            flat = positions.reshape(-1, positions.shape[-1])
            out = np.empty(flat.shape, dtype=np.float64)
            for row in range(flat.shape[0]):
                order = np.argsort(flat[row])
                for rank in range(order.shape[0]):
                    out[row, order[rank]] = (rank / max(1, order.shape[0] - 1)) ** power
            return out.reshape(positions.shape)

        return ranked

    return [make(1.0), make(2.0), make(0.5)]


@pytest.fixture
def jit_scored(scratch_registry):
    """A registered eviction policy, ``jit_scored``, whose scores come from :func:`fresh_jit_scorers`."""
    scorers = fresh_jit_scorers()

    @dataclass
    class JitScored(Eviction):
        """Keeps the newest tokens, ranked by numba functions compiled on their first call."""

        reads_kv = False
        order_free = True

        def score(self, view: LayerView) -> torch.Tensor:
            positions = view.positions.numpy()
            scores = sum(scorer(positions) for scorer in scorers)
            return torch.from_numpy(scores).float().masked_fill(~view.valid, -torch.inf)

    registry.register("jit_scored")(JitScored)
    return "jit_scored"


def loaded_model() -> LoadedModel:
    return LoadedModel(tiny_byte_model(context=256), ByteTokenizer(), "tiny", 256)


def test_a_configuration_s_timing_does_not_include_its_first_compilation(jit_scored):
    """The same policy twice in one run: the first pays the compilation in its warm-up (its first
    call's extra seconds, above every timed call), the second pays none, and their timed speeds
    fall within each other's range."""
    loaded = loaded_model()
    runs = [CompareRun("full", None), CompareRun(jit_scored, 0.25), CompareRun(jit_scored, 0.25)]
    measured = measure_speeds(loaded, runs, speed_run(loaded, 64, 2, ROUNDS))
    (_, full), (_, first), (_, again) = measured
    assert [run.error for run in runs] == [None] * 3
    slowest_timed_call = max(first.walls + again.walls)
    assert first.first_call_s > slowest_timed_call  # the compilation is in the warm-up, in no timed round
    assert again.first_call_s < first.first_call_s / 2  # compiled already: its first call is about a timed one
    assert first.speed.overlaps(again.speed), (first.tokens_per_s, again.tokens_per_s)
    assert runs[1].speed.first_call_s == first.first_call_s and runs[1].speed.tokens_per_s == tuple(first.tokens_per_s)
    assert runs[1].speed.vs_full == tuple(first.vs(full)) and len(runs[1].speed.vs_full) == ROUNDS


def test_every_configuration_is_timed_in_every_round_with_the_full_cache_first():
    loaded = loaded_model()
    runs = [CompareRun("streaming_llm", 0.5), CompareRun("full", None), CompareRun("streaming_llm", 0.25)]
    rounds = []
    calls = []
    measured = measure_speeds(
        loaded,
        runs,
        speed_run(loaded, 128, 2, 2),
        on_call=lambda r, i: calls.append((r, i)),
        on_round=lambda r: rounds.append([run.speed and len(run.speed.tokens_per_s) for run in runs]),
    )
    assert [run.label for run, _ in measured] == ["full", "streaming_llm @ 0.5", "streaming_llm @ 0.25"]  # the full cache first
    assert calls == [(r, i) for r in range(3) for i in range(3)]
    assert rounds == [[None, None, None], [1, 1, 1], [2, 2, 2]]  # the runs hold each round as it ends
    assert runs[1].speed.vs_full == (1.0, 1.0) and runs[1].kv_fraction == 1.0
    assert 0.4 <= runs[0].kv_fraction <= 0.7 and runs[2].kv_fraction < 0.45  # bytes from the last speed run
    assert all(run.prefill[SPEED] == SHARED for run in runs)


def test_separate_prefills_and_a_failing_configuration():
    loaded = loaded_model()
    failed_earlier = CompareRun("snapkv", 0.5, error="ValueError: earlier")
    runs = [CompareRun("full", None), CompareRun("streaming_llm", 0.25), failed_earlier]
    measured = measure_speeds(loaded, runs, speed_run(loaded, 128, 2, 1), shared=False)
    assert [run for run, _ in measured] == runs[:2]  # a run that failed before is not timed
    assert all(run.prefill == {} for run in runs) and failed_earlier.speed is None
    with pytest.raises(ValueError, match="against the full cache: the runs must hold 'full'"):
        measure_speeds(loaded, runs[1:], speed_run(loaded, 128, 2, 1))


def test_a_configuration_that_raises_while_timed_keeps_its_error(scratch_registry):
    @dataclass
    class Broken(Eviction):
        """Raises when asked for scores."""

        def score(self, view: LayerView) -> torch.Tensor:
            raise RuntimeError("broken scores\nmore")

    registry.register("broken")(Broken)
    loaded = loaded_model()
    runs = [CompareRun("full", None), CompareRun("broken", 0.25)]
    measure_speeds(loaded, runs, speed_run(loaded, 128, 2, 2))
    assert runs[1].error == "RuntimeError: broken scores" and runs[1].speed is None
    assert runs[0].error is None and len(runs[0].speed.tokens_per_s) == 2


@pytest.mark.slow
def test_kvlib_s_own_kernels_compile_in_the_warm_up_in_a_fresh_process(tmp_path):
    """The issue's case in a new process (nothing compiled yet: numba's cache an empty folder, not
    the one earlier runs filled): ``kivi(bits=4)`` twice in one comparison, on the embedded model;
    its coded-page kernel compiles in the first one's warm-up."""
    script = textwrap.dedent(
        """
        from kvlib.eval import compare, load_model
        loaded = load_model("default")
        runs = compare(loaded, ["kivi(bits=4)", "kivi(bits=4)"], [0.5], [], context=256, speed_steps=8, speed_rounds=7, progress=False)
        for run in runs:
            print(run.speed.first_call_s, min(run.speed.tokens_per_s), max(run.speed.tokens_per_s))
        """
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    lines = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env).stdout.split("\n")
    (_, _, _), (first_call, first_low, first_high), (again_call, again_low, again_high) = [
        [float(value) for value in line.split()] for line in lines if line
    ]
    assert first_call > 1.0 and again_call < first_call / 2
    assert first_low <= again_high and again_low <= first_high
