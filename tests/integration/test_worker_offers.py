"""--offer-before-start against a real Redis: the engine readies a piece's jobs before the
start script's verdict, and runs only those the script starts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producer import AsyncProducer
from producer.protocol import GenerationRequest
from worker.broker import Broker
from worker.engines.echo import EchoEngine

pytestmark = pytest.mark.integration


class IntakeEngine(EchoEngine):
    """Echo that records the jobs it prepared and the jobs it started."""

    def __init__(self) -> None:
        super().__init__(capacity=8, tokens_per_second=1000)
        self.prepared: list[str] = []
        self.started: list[str] = []

    def prepare(self, job_id: str, request: GenerationRequest) -> object:
        self.prepared.append(job_id)
        return super().prepare(job_id, request)

    def add(self, job_id: str, request: GenerationRequest) -> None:
        self.started.append(job_id)
        super().add(job_id, request)


async def test_a_job_cancelled_while_queued_is_offered_but_never_started(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    engine = IntakeEngine()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        cancelled = await producer.submit("never runs", max_new_tokens=3)
        assert await cancelled.cancel() == "queued"
        runs = await producer.submit("runs", max_new_tokens=3)
        await start_worker(engine=engine)
        results = await asyncio.wait_for(
            asyncio.gather(cancelled.result(), runs.result()), timeout=10
        )
    assert [r.state for r in results] == ["cancelled", "done"]
    # One read took both: both were offered, the start script started one.
    assert engine.prepared == [cancelled.id, runs.id]
    assert engine.started == [runs.id]


async def test_a_failed_start_script_withdraws_the_offers_and_the_job_runs_once_later(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = Broker.start_jobs
    failed: list[bool] = []

    async def start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> Any:
        if not failed:
            failed.append(True)
            raise RedisConnectionError("connection reset while starting a piece")
        return await real_start(self, jobs)

    monkeypatch.setattr(Broker, "start_jobs", start_jobs)
    engine = IntakeEngine()
    # The entry stays pending after the failure: a reclaim brings it back.
    await start_worker(engine=engine, claim_idle_ms=300)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("runs after a retry", max_new_tokens=3)
        result = await asyncio.wait_for(handle.result(), timeout=20)
    assert failed and result.state == "done" and result.attempts == 1
    # Offered twice (the read, then the reclaim); started once.
    assert engine.prepared == [handle.id, handle.id]
    assert engine.started == [handle.id]
