"""bench.path_trace records a run's timeline in the worker, its engine process and the SDK
(on the echo engine), and puts back what it wrapped."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import path_trace
from bench.baselines import random_prompt_ids
from bench.exlq_path import ExlqPath
from producer.submit_batch import SubmitBatcher
from producer.subscriber import EventRouter
from worker.runner import ACCEPT_PIECE

pytestmark = pytest.mark.integration


def test_a_traced_run_gives_each_stage_of_the_path_in_order(
    tmp_path: Path, echo_bench_model: Path
) -> None:
    model = echo_bench_model
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    jobs = ACCEPT_PIECE + 8
    originals = (EventRouter._push, SubmitBatcher._send)
    with (
        path_trace.BenchTrace() as bench_trace,
        ExlqPath(
            model,
            max_batch_size=64,
            engine="echo",
            worker_module="bench.path_trace",
            worker_env={path_trace.TRACE_ENV: str(trace_dir)},
        ) as path,
    ):
        row = path.run(
            random_prompt_ids(model, jobs, 16, seed=1),
            random_prompt_ids(model, jobs, 16, seed=2),
            max_new_tokens=4,
        )
        t0, times, _, sdk_first = bench_trace.take()
        sends = bench_trace.last_sends
    assert (EventRouter._push, SubmitBatcher._send) == originals
    assert row["completion_tokens"] == 4 * jobs
    # Both of the worker's processes wrote their records.
    assert len(list(trace_dir.glob("*.jsonl"))) == 2
    timeline = path_trace.exlq_timeline(
        path_trace.read_worker_trace(trace_dir, t0, t0 + row["wall_s"]), t0, steps_shown=8
    )
    # The SDK sent the burst in pieces, and every job's first event reached it.
    assert sum(n for _, _, n in sends) == jobs
    assert len(sdk_first) == jobs
    # Each piece the worker accepted was handed over and received by the engine process.
    assert len(timeline["pieces_handed"]) == len(timeline["engine_recv"]) >= 2
    assert sum(n for *_, n in timeline["engine_apply"]) == jobs
    first_step_begin = timeline["steps"][0][0]
    # (The engine process may note its receipt before the worker notes its send's end.)
    assert timeline["pieces_begin"][0] <= timeline["engine_recv"][0] <= first_step_begin
    assert first_step_begin <= timeline["reports_in"][0][0] <= timeline["commits_end"][0]
    # The first step's chunks are the first token of the jobs it ran.
    assert timeline["steps"][0][3] == timeline["steps"][0][2] > 0
    groups = path_trace.group_medians([tt[0] for tt in times], t0)
    assert len(groups) == 2 and groups[0] <= groups[1]


def test_group_medians_are_per_slice_of_jobs_in_submit_order() -> None:
    # One full group 1 ms apart from t0 + 0 ms, then a group of two.
    first = [1.0 + i / 1000 for i in range(path_trace.GROUP)] + [2.0, 2.002]
    assert path_trace.GROUP == 32
    assert path_trace.group_medians(first, 1.0) == [15.5, 1001.0]
