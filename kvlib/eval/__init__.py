"""Evaluation tasks and the policy comparison behind ``kvlib compare``.

Tasks (:mod:`.needle`, :mod:`.perplexity`, :mod:`.agreement`, :mod:`.jsonl`, :mod:`.kvpress_task`) score a model whose
cache comes from a factory, so the same task runs with the full cache and with any spec.
:func:`~kvlib.eval.compare.compare` runs a grid of policies x budgets x tasks;
:mod:`.report` and :mod:`.plots` write its table, JSON, CSV and PNGs, with the intervals and paired
tests of :mod:`.significance`. :mod:`.decode_timing` times decodes (a warm-up run of each
configuration, then interleaved rounds) for the comparison and the decode benchmarks.
"""

from kvlib.eval.agreement import AgreementTask
from kvlib.eval.compare import compare
from kvlib.eval.compare_units import CompareRun
from kvlib.eval.jsonl import JsonlTask, load_jsonl
from kvlib.eval.kvpress_task import KvpressTask, load_kvpress
from kvlib.eval.models import ModelLoadError, load_model
from kvlib.eval.needle import NeedleTask
from kvlib.eval.perplexity import PerplexityTask
from kvlib.eval.task import TaskResult
from kvlib.eval.task_table import parse_tasks

__all__ = [
    "AgreementTask",
    "CompareRun",
    "JsonlTask",
    "KvpressTask",
    "ModelLoadError",
    "NeedleTask",
    "PerplexityTask",
    "TaskResult",
    "compare",
    "load_jsonl",
    "load_kvpress",
    "load_model",
    "parse_tasks",
]
