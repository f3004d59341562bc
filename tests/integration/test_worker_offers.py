"""--offer-before-start against a real Redis: the engine readies a piece's jobs before the
start script's verdict, and runs only those the script starts."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from exlq.producer import AsyncProducer
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.protocol.models import DoneEvent, GenerationRequest, TokenEvent
from exlq.worker.broker import Broker
from exlq.worker.engines.base import PreparesJobs
from exlq.worker.engines.echo.engine import EchoEngine

pytestmark = pytest.mark.integration


class IntakeEngine(EchoEngine, PreparesJobs):
    """Echo that records the jobs it prepared and the jobs it started."""

    def __init__(self) -> None:
        super().__init__(capacity=8, tokens_per_second=1000)
        self.prepared: list[str] = []
        self.started: list[str] = []

    def prepare(self, job_id: str, request: GenerationRequest) -> object:
        self.prepared.append(job_id)
        return request

    def admit(self, job_id: str, prepared: object) -> None:
        assert isinstance(prepared, GenerationRequest)
        self.add(job_id, prepared)

    def add(self, job_id: str, request: GenerationRequest) -> None:
        self.started.append(job_id)
        super().add(job_id, request)


async def test_a_job_cancelled_while_queued_is_offered_but_never_seen_to_run(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = IntakeEngine()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        cancelled = await producer.submit("never runs", max_new_tokens=3)
        assert await cancelled.cancel() == "queued"
        runs = await producer.submit("runs", max_new_tokens=3)
        await start_worker(engine=engine)
        cancelled_events = await asyncio.wait_for(_events(cancelled), timeout=10)
        results = await asyncio.wait_for(
            asyncio.gather(cancelled.result(), runs.result()), timeout=10
        )
    assert [r.state for r in results] == ["cancelled", "done"]
    # Its subscriber saw its end alone: no token, though the engine may have started it.
    assert [type(e).__name__ for e in cancelled_events] == ["DoneEvent"]
    assert results[0].text == "" and results[0].usage.completion_tokens == 0
    # One read took both: both were offered, and the engine started both before the
    # start script's verdict, which refused one.
    assert engine.prepared == [cancelled.id, runs.id]
    assert engine.started == [cancelled.id, runs.id]
    # What the engine made of it before it was stopped was dropped as expected, not as
    # output of a job the worker does not know.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_failed_start_script_withdraws_the_offers_and_the_job_runs_once_later(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_start = Broker.start_jobs
    failed: list[bool] = []

    async def start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> Any:
        if not failed:
            failed.append(True)
            await asyncio.sleep(0.05)  # the engine, started early, makes output meanwhile
            raise RedisConnectionError("connection reset while starting a piece")
        return await real_start(self, jobs)

    monkeypatch.setattr(Broker, "start_jobs", start_jobs)
    engine = IntakeEngine()
    # The entry stays pending after the failure: a reclaim brings it back.
    await start_worker(engine=engine, claim_idle_ms=300)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("runs after a retry", max_new_tokens=3)
        events = await asyncio.wait_for(_events(handle), timeout=20)
        result = await asyncio.wait_for(handle.result(), timeout=20)
    assert failed and result.state == "done" and result.attempts == 1
    # Its events are those of the one run the script started: nothing of the start that
    # was stopped for want of a verdict.
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.seq for e in events] == list(range(len(events))) and len(tokens) == 3
    assert "".join(t.text for t in tokens) == result.text
    # Offered twice (the read, then the reclaim); started early both times, the first
    # start stopped for want of a verdict.
    assert engine.prepared == [handle.id, handle.id]
    assert engine.started == [handle.id] * 2


async def test_output_of_a_job_started_early_waits_for_its_verdict(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start script slower than the engine's first steps: the job's tokens go out after
    the script started it, in order, with the attempt it counted."""
    real_start = Broker.start_jobs

    async def slow_start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> Any:
        await asyncio.sleep(0.1)  # the echo engine makes 50 tokens meanwhile
        return await real_start(self, jobs)

    monkeypatch.setattr(Broker, "start_jobs", slow_start_jobs)
    engine = IntakeEngine()
    await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("slow start", max_new_tokens=4)
        events = await asyncio.wait_for(_events(handle), timeout=10)
        result = await asyncio.wait_for(handle.result(), timeout=10)
    assert engine.started == [handle.id]
    assert [e.seq for e in events] == list(range(5)) and {e.attempt for e in events} == {1}
    assert isinstance(events[-1], DoneEvent) and result.state == "done"
    assert result.timings.queued_s <= result.timings.first_token_s  # type: ignore[operator]


async def test_a_reclaim_due_while_a_read_waits_for_its_verdict_stops_neither_piece(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reclaim falls due while a piece waits for its slow start script. One piece at a
    time: the other's verdict must not stop the jobs started early, nor may the reclaim
    take the waiting piece's own entries back. Every job runs once and ends."""
    real_start = Broker.start_jobs
    calls: list[list[str]] = []

    async def start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> Any:
        calls.append([job_id for job_id, _ in jobs])
        if len(calls) == 1:
            await asyncio.sleep(0.3)  # the other piece is due meanwhile
        return await real_start(self, jobs)

    monkeypatch.setattr(Broker, "start_jobs", start_jobs)
    keys = QueueKeys(queue_name)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        # A worker that read this one, then stopped: a reclaim brings it back.
        abandoned = await producer.submit("abandoned", max_new_tokens=3)
        await redis_client.xgroup_create(keys.jobs, CONSUMER_GROUP, id="0")
        assert await redis_client.xreadgroup(CONSUMER_GROUP, "gone", {keys.jobs: ">"}, count=1)
        await asyncio.sleep(0.5)
        fresh = await producer.submit("fresh", max_new_tokens=3)
        engine = IntakeEngine()
        await start_worker(engine=engine, claim_idle_ms=450)
        results = await asyncio.wait_for(
            asyncio.gather(abandoned.result(), fresh.result()), timeout=10
        )
    assert sorted(calls) == sorted([[abandoned.id], [fresh.id]])
    assert [(r.state, r.text) for r in results] == [
        ("done", " abandoned" * 3),
        ("done", " fresh" * 3),
    ]
    assert [r.attempts for r in results] == [1, 1]  # "gone" never started its entry
    assert sorted(engine.started) == sorted([abandoned.id, fresh.id])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _events(handle: Any) -> list[Any]:
    return [event async for event in handle.stream()]
