"""worker/tracing.py: a tracer sees a job's stages in order, in both of the worker's
processes; with none installed nothing is recorded."""

from __future__ import annotations

import gc
import json
import os
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exlq.producer import AsyncProducer
from exlq.protocol.models import GenerationRequest
from exlq.worker import tracing
from exlq.worker.engine_loop import StepReport
from exlq.worker.engine_process import EngineProcess
from exlq.worker.engines.base import JobEnded
from exlq.worker.settings import WorkerSettings

JOBS = 3


@pytest.fixture
def recorder() -> Iterator[tracing.Recorder]:
    recorder = tracing.Recorder()
    previous = tracing.install(recorder)
    yield recorder
    tracing.install(previous)


async def _round_trip(redis_url: str, queue_name: str) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [await producer.submit(f"job {i}", max_new_tokens=3) for i in range(JOBS)]
        for handle in handles:
            await handle.result(timeout=10)


@pytest.mark.integration
async def test_a_round_trip_passes_every_stage_in_order(
    recorder: tracing.Recorder, redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()  # the echo engine on a thread of the worker: one process, one tracer
    await _round_trip(redis_url, queue_name)
    names = recorder.names()
    # The way in: a piece, its jobs parsed, offered and prepared, added to the engine; the
    # first step; its report's way out to Redis.
    way: list[tracing.Stage] = [
        "piece_begun",
        "job_parsed",
        "offer_prepared",
        "jobs_added",
        "step_begun",
        "step_ended",
        "report_received",
    ]
    firsts = [names.index(stage) for stage in way]
    assert firsts == sorted(firsts)
    commit = names.index("commit_begun", firsts[-1])
    assert names.index("commit_ended", commit) > commit
    assert names.index("piece_started") > names.index("job_parsed")
    assert names.count("job_parsed") == JOBS
    fields = [f for _, name, f in recorder.records if name in ("piece_begun", "jobs_added")]
    assert sum(f["n"] for f in fields) == 2 * JOBS  # each job read once and added once


@pytest.mark.integration
async def test_with_no_tracer_nothing_is_recorded(
    recorder: tracing.Recorder, redis_url: str, queue_name: str, start_worker: Any
) -> None:
    tracing.install(None)
    await start_worker()
    await _round_trip(redis_url, queue_name)
    assert tracing.tracer is None
    assert recorder.records == []


def test_a_trace_file_in_the_settings_traces_the_spawned_engine_process_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("EXLQ_TRACE_FILE", str(trace))
    settings = WorkerSettings.load({"tokens_per_second": 1000}, engine="echo", max_batch_size=4)
    assert settings.serving.trace_file == trace
    # This process traces as `exlq worker` would (without its collection clock here).
    file_tracer = tracing.FileTracer(trace)
    previous = tracing.install(file_tracer)
    engine = EngineProcess(settings)
    try:
        engine.load()
        reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
        engine.start(reports.put)
        request = GenerationRequest(prompt="traced", max_new_tokens=2)
        engine.offer(1, [("a", request)])
        engine.admit(1, [("a", None)])
        while not any(isinstance(o, JobEnded) for o in reports.get(timeout=20).outputs):
            pass
        engine.stop(20)
    finally:
        tracing.install(previous)
        file_tracer.close()
        engine.close()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    by_pid: dict[int, list[str]] = {}
    for record in records:
        by_pid.setdefault(record["pid"], []).append(record["stage"])
    assert set(by_pid) == {engine.pid, os.getpid()}
    assert by_pid[os.getpid()] == ["offer_sent", "admit_sent"]
    child = [stage for stage in by_pid[engine.pid] if stage != "collected"]
    # The admit may be read before the offer is prepared (both in one read of the pipe).
    way = ["command_read", "offer_prepared", "jobs_added", "step_begun", "step_ended"]
    at = [child.index(stage) for stage in [*way, "report_sent"]]
    assert at == sorted(at)
    kinds = [r["kind"] for r in records if r["stage"] == "command_read"]
    assert kinds == ["offer", "admit", "stop"]


def test_a_traced_process_reports_its_long_collections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace.jsonl"
    callbacks = list(gc.callbacks)
    monkeypatch.setattr(tracing, "COLLECTION_MIN_S", 0.0)  # every collection counts
    try:
        tracing.trace_to_file(trace)
        assert isinstance(tracing.tracer, tracing.FileTracer)
        gc.collect()
    finally:
        installed = tracing.install(None)
        assert isinstance(installed, tracing.FileTracer)
        installed.close()
        gc.callbacks[:] = callbacks
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records and all(r["stage"] == "collected" for r in records)
    assert records[-1]["generation"] == 2 and records[-1]["begin"] <= records[-1]["t"]


def test_no_trace_file_installs_nothing() -> None:
    callbacks = list(gc.callbacks)
    tracing.trace_to_file(None)
    assert tracing.tracer is None
    assert gc.callbacks == callbacks
