"""The policy comparison on a Ray cluster (``kvlib compare --ray [ADDRESS]``).

The comparison's units (:class:`kvlib.eval.compare_units.Unit`: one configuration on one task, or its
decode-speed run) run as Ray tasks, through the same :func:`~kvlib.eval.compare_units.run_unit` as the
serial loop. Each worker process loads the model by its name once (:func:`worker_model`, cached
per process: Ray reuses its workers), so the model name must load on every node (``default``,
``smollm2`` and ``gemma3-270m`` do, the last where the ``models`` extra is installed; a folder or
a ``jsonl:`` file must exist at the same path there). Outcomes are
put back in the serial order, and a configuration is recorded as the serial loop records it
(stopping at its first error), so the table, JSON, CSV and plots hold the same scores and bytes.
Decode speed differs: each configuration's speed unit times it against the full cache in its own
worker (both warmed up, then interleaved rounds: :func:`~kvlib.eval.compare_units.run_unit`), so its
ratio to the full cache is taken under that worker's load, while units run side by side.

Each unit reserves ``threads`` CPUs of the cluster and runs torch on that many threads (default
one: Ray's one task per CPU).

Ray is the optional ``kvlib[ray]`` extra; :func:`connect` says so when it is missing. Nothing here
runs at import time, and ``ray`` is imported only by these functions.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvlib.devices import set_cpu_threads
from kvlib.errors import quoted
from kvlib.eval.compare_units import (
    CompareRun,
    Outcome,
    SpeedRun,
    Unit,
    check_inputs,
    check_speed,
    configurations,
    progress_bar,
    run_unit,
    speed_run,
    units,
)
from kvlib.eval.models import LoadedModel, load_model
from kvlib.eval.task import Task

LOCAL = ""
"""The ``--ray`` address that starts a local Ray cluster (or joins the one this process has)."""
PROBE_SECONDS = 5.0
"""How long :func:`check_address` waits for a cluster's port to accept a connection."""


def check_address(address: str) -> None:
    """Raise ``ValueError`` (one line) unless ``address`` is ``""`` (a local cluster), ``auto`` (the
    cluster ``ray start`` runs on this machine, or ``$RAY_ADDRESS``), ``HOST:PORT`` (a cluster's
    GCS address) or ``ray://HOST:PORT`` (Ray Client) whose port accepts a TCP connection within
    :data:`PROBE_SECONDS`. ``ray.init`` itself retries an unreachable address for minutes."""
    if address in (LOCAL, "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--ray takes HOST:PORT, ray://HOST:PORT or auto (nothing: a local cluster), got {quoted(address)}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise ValueError(f"--ray {quoted(address)}: no Ray cluster answers there ({exc.strerror or exc})") from None


@contextmanager
def connect(address: str) -> Iterator[None]:
    """Ray, ready for :func:`compare_on_ray`, for the ``with`` block: this process's Ray when it has
    one, else a local cluster (``address`` ``""``) or the cluster at ``address``. Raises
    ``ValueError`` (one line) before anything starts when ray is not installed or the address is
    bad; shuts down on exit only what it started."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'kvlib[ray]'") from None
    check_address(address)
    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address or None, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ValueError(f"--ray {quoted(address)}: {str(exc).strip().splitlines()[0]}") from None
    try:
        yield
    finally:
        ray.shutdown()


@functools.lru_cache(maxsize=2)
def worker_model(name: str) -> LoadedModel:
    """The model ``name`` loaded in this worker process, once per process."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return load_model(name)


@functools.lru_cache(maxsize=4)
def worker_speed(name: str, context: int, speed_steps: int, speed_rounds: int) -> SpeedRun:
    """:func:`~kvlib.eval.compare_units.speed_run` for the model ``name``, once per process."""
    return speed_run(worker_model(name), context, speed_steps, speed_rounds)


def run_unit_on_worker(name: str, unit: Unit, context: int, speed_steps: int, speed_rounds: int, threads: int) -> Outcome:
    """The body of one Ray task: :func:`~kvlib.eval.compare_units.run_unit` on the model ``name``."""
    set_cpu_threads(threads)
    speed = worker_speed(name, context, speed_steps, speed_rounds) if unit.task is None else None
    return run_unit(worker_model(name), unit, speed)


def compare_on_ray(
    loaded: LoadedModel,
    policies: Sequence[str],
    budgets: Sequence[float],
    tasks: Sequence[Task],
    *,
    context: int,
    speed_steps: int = 32,
    speed_rounds: int = 3,
    threads: int = 1,
    progress: bool = True,
    on_run: Callable[[list[CompareRun]], None] | None = None,
) -> list[CompareRun]:
    """:func:`kvlib.eval.compare.compare` with its units run as Ray tasks (inside :func:`connect`).

    ``loaded`` is this process's copy, used for the checks; the workers load ``loaded.name``. The
    bar advances as units finish, in any order; ``on_run`` gets the finished configurations in the
    serial order each time one more finishes. A unit still running when this is interrupted is
    cancelled."""
    import ray

    check_inputs(loaded, policies, budgets, tasks)
    check_speed(context, speed_steps, speed_rounds)
    configs = configurations(policies, budgets)
    plan = [units(policy, budget, tasks) for policy, budget in configs]
    remote = ray.remote(run_unit_on_worker).options(num_cpus=threads)
    where = {}
    for index, todo in enumerate(plan):
        for position, unit in enumerate(todo):
            where[remote.remote(loaded.name, unit, context, speed_steps, speed_rounds, threads)] = (index, position)
    outcomes: list[list[Outcome | None]] = [[None] * len(todo) for todo in plan]
    runs: list[CompareRun | None] = [None] * len(plan)
    pending = list(where)
    try:
        with progress_bar(configs, tasks, 1, progress) as bar:
            while pending:
                (ref,), pending = ray.wait(pending, num_returns=1)
                index, position = where[ref]
                outcomes[index][position] = _result(ray, ref)
                bar.set_postfix_str(plan[index][position].label)
                bar.update()
                if all(outcome is not None for outcome in outcomes[index]):
                    runs[index] = _assemble(*configs[index], outcomes[index])
                    if on_run is not None:
                        on_run([run for run in runs if run is not None])
    finally:
        for ref in pending:
            ray.cancel(ref)
    return runs


def _assemble(policy: str, budget: float | None, outcomes: Sequence[Outcome]) -> CompareRun:
    """A configuration's run from its outcomes in serial order, recorded as the serial loop does."""
    run = CompareRun(policy, budget)
    for outcome in outcomes:
        if not outcome.record(run):
            break
    return run


def _result(ray, ref) -> Outcome:
    """A finished task's outcome; a task that failed outside :func:`run_unit` (the model did not
    load on its node, the worker died) raises its cause with one line."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        line = (str(exc.cause).strip() or type(exc.cause).__name__).splitlines()[0]
        raise (ValueError if isinstance(exc.cause, ValueError) else RuntimeError)(line) from None
    except ray.exceptions.RayError as exc:
        raise RuntimeError(f"a Ray task failed: {str(exc).strip().splitlines()[0]}") from None
