"""The bench's exlq harness (system b) counts what the path delivers, on the echo engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import thread_clock
from bench.baselines import percentiles, random_prompt_ids
from bench.exlq_path import ExlqPath

pytestmark = pytest.mark.integration


def test_a_run_through_the_path_counts_every_token_and_times_its_parts(
    echo_bench_model: Path,
) -> None:
    model = echo_bench_model
    # Placed as bench.paired places them: the worker on the server's CPUs, Redis beside the
    # clients on the load's (one CPU each here; the same one on a one-CPU machine).
    cpus = sorted(os.sched_getaffinity(0))
    server, load = frozenset(cpus[:1]), frozenset(cpus[-1:])
    with ExlqPath(
        model, max_batch_size=8, engine="echo", worker_cpus=server, redis_cpus=load
    ) as path:
        assert path.redis_pid is not None and path.worker_pid is not None
        assert os.sched_getaffinity(path.redis_pid) == load
        assert os.sched_getaffinity(path.worker_pid) == server
        assert os.sched_getaffinity(0) == set(cpus)  # this thread's CPUs given back
        rows = [
            path.run(
                random_prompt_ids(model, n, 16, seed=1),
                random_prompt_ids(model, n, 16, seed=2),
                max_new_tokens=12,
            )
            for n in (1, 8)
        ]
    for n, row in zip((1, 8), rows, strict=True):
        assert row["concurrency"] == n
        assert row["completion_tokens"] == 12 * n
        assert row["output_tokens_per_s"] > 0
        assert 0 < row["ttft_ms_p50"] < row["wall_s"] * 1000
        # Each job's first event, in the prompts' order, for bench.paired's job-by-job figure.
        jobs = row["ttft_ms_jobs"]
        assert len(jobs) == n and all(t is not None and 0 < t < row["wall_s"] * 1000 for t in jobs)
        assert percentiles(jobs, [50]) == [pytest.approx(row["ttft_ms_p50"], abs=1e-3)]
        # The echo engine holds no text back: every job's first event carries one token.
        assert row["first_event_tokens"] == [1] * n
        # The parts of the TTFT that the SDK and the worker's done events report.
        assert row["submit_ms_p50"] > 0 and row["queued_ms_p50"] >= 0
        # The worker's step metric moved: the run was read from /metrics.
        assert row["steps"] >= 12
        # The engine process's stepping thread was found and its time per step counted.
        assert row["stepper_run_us_per_step"] > 0
        assert row["stepper_wait_us_per_step"] >= 0
        assert row["others_run_us_per_step"] > 0  # the worker's event loop, at least


def test_the_engines_stepping_thread_is_pinned_alone_and_the_worker_keeps_the_rest(
    echo_bench_model: Path,
) -> None:
    model = echo_bench_model
    cpus = frozenset(os.sched_getaffinity(0))
    alone = max(cpus)
    with ExlqPath(model, max_batch_size=8, engine="echo", worker_cpus=cpus) as path:
        with pytest.raises(RuntimeError, match="no run yet"):
            path.pin_stepper(alone)
        prompts = random_prompt_ids(model, 8, 16, seed=1)
        path.run(prompts, random_prompt_ids(model, 8, 16, seed=2), max_new_tokens=12)
        if len(cpus) < 2:
            with pytest.raises(ValueError, match="besides"):
                path.pin_stepper(alone)
            return
        path.pin_stepper(alone)
        assert path.worker_pid is not None
        engine_pid = thread_clock.spawned_child(path.worker_pid)
        assert engine_pid is not None
        threads = thread_clock.snapshot([path.worker_pid, engine_pid])
        placed = {key: os.sched_getaffinity(key[1]) for key in threads}
        pinned = [pid for (pid, _), on in placed.items() if on == {alone}]
        assert pinned == [engine_pid]  # one thread of the engine's process
        assert all(on == cpus - {alone} for on in placed.values() if on != {alone})
        # The worker serves as before.
        row = path.run(
            random_prompt_ids(model, 8, 16, seed=3),
            random_prompt_ids(model, 8, 16, seed=4),
            max_new_tokens=12,
        )
        assert row["completion_tokens"] == 12 * 8
