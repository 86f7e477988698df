"""``compare`` with shared prefills: the same results as configuration by configuration, each
run's path recorded per task; a configuration that cannot share (tiering) and a task without a
shared path (perplexity) run apart and say why."""

from __future__ import annotations

import dataclasses

from kvlib.default_model import ByteTokenizer
from kvlib.eval.compare import compare
from kvlib.eval.models import LoadedModel
from kvlib.eval.perplexity import PerplexityTask
from kvlib.eval.report import markdown_table
from kvlib.eval.ruler import RULER_TASKS
from kvlib.eval.shared_compare import SHARED
from tests.eval.conftest import tiny_byte_model


def test_shared_prefills_give_separate_runs_results_and_say_which_path_each_took():
    loaded = LoadedModel(tiny_byte_model(context=512), ByteTokenizer(), "tiny", 512)
    ruler = RULER_TASKS["niah_single"](context=512, samples=2, batch_size=2, tokens_to_generate=6)
    tasks = [ruler, PerplexityTask(context=128, samples=1)]
    policies = ["snapkv", "streaming_llm+lru(device_mb=0.02)"]
    options = dict(context=128, speed_steps=2, progress=False)
    shared = compare(loaded, policies, [0.25], tasks, **options)
    separate = compare(loaded, policies, [0.25], tasks, shared_prefill=False, **options)
    assert [run.error for run in shared] == [None] * 3
    for ours, theirs in zip(shared, separate):
        assert ours.results == theirs.results and ours.kv_bytes == theirs.kv_bytes
        assert theirs.prefill == {}
    assert [run.prefill["niah_single"] for run in shared] == [
        SHARED,
        SHARED,
        "separate: tiering (lru(device_mb=0.02)) places pages as the calls run",
    ]
    assert all(run.prefill["perplexity"].startswith("separate: perplexity runs each") for run in shared)
    assert [run.prefill["decode speed"] for run in shared] == [SHARED, SHARED, shared[2].prefill["niah_single"]]
    assert "Prefill: 4 (configuration, task) pairs shared" in markdown_table(shared)
    first = dataclasses.replace(ruler, context_first=True)
    apart = compare(loaded, ["snapkv"], [0.25], [first], **options)
    assert all(run.prefill["niah_single"].startswith("separate: niah_single runs each") for run in apart)
