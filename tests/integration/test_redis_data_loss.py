"""Redis loses its data (a restart without persistence, FLUSHALL) under load: workers create
the consumer group again and serve what comes next, the jobs Redis lost are announced as
lost, no event is published twice, and readiness never says ready while reads fail."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys
from exlq.worker.embedded_redis import RedisServer
from tests.conftest import wait_until
from tests.raw_events import RawEvents, raw_events

pytestmark = pytest.mark.integration

QUICK = {"echo_tokens_per_second": 50.0, "claim_idle_ms": 1000, "heartbeat_seconds": 0.2}


async def _running(recorder: RawEvents, job_ids: list[str]) -> None:
    """Until every job has published a token."""
    await wait_until(
        lambda: all(any(e["type"] == "token" for e in recorder.of(j)) for j in job_ids), 10
    )


def _lost_announced(recorder: RawEvents, job_id: str) -> bool:
    return any(e["type"] == "error" and e["error"]["code"] == "lost" for e in recorder.of(job_id))


def _errors(recorder: RawEvents, job_id: str) -> int:
    return sum(e["type"] == "error" for e in recorder.of(job_id))


def _after_lost(recorder: RawEvents, job_id: str) -> list[dict[str, Any]]:
    events = recorder.of(job_id)
    ends = [i for i, e in enumerate(events) if e["type"] == "error"]
    return events[ends[0] + 1 :] if ends else []


async def _serves_new_jobs(url: str, queue: str) -> float:
    """Seconds until jobs submitted now are all done."""
    began = time.monotonic()
    async with AsyncProducer(url, queue=queue) as producer:
        handles = [await producer.submit(f"after {i}", max_new_tokens=3) for i in range(4)]
        results = await asyncio.gather(*(h.result(timeout=15) for h in handles))
    assert [r.state for r in results] == ["done"] * 4
    return time.monotonic() - began


async def test_flushall_under_load_loses_only_what_redis_held_and_serves_on(
    redis_url: str, queue_name: str, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_worker(**QUICK)
    async with raw_events(redis_url) as recorder:
        async with AsyncProducer(redis_url, queue=queue_name) as producer:
            inflight = [
                (await producer.submit(f"long {i}", max_new_tokens=200)).id for i in range(4)
            ]
            await _running(recorder, inflight)
            client = aioredis.Redis.from_url(redis_url)
            await client.flushall()
            await client.aclose()
            took_s = await _serves_new_jobs(redis_url, queue_name)
            await wait_until(lambda: all(_lost_announced(recorder, j) for j in inflight), 10)
        await asyncio.sleep(0.5)  # anything a stopped job still had on its way
    print(f"\nflushall: new jobs served in {took_s:.2f}s; repeats={len(recorder.repeats())}")
    assert recorder.repeats() == {}
    assert all(not _after_lost(recorder, j) for j in inflight)
    assert [_errors(recorder, j) for j in inflight] == [1] * len(inflight)
    assert not any(e["type"] == "done" for j in inflight for e in recorder.of(j))
    assert running.worker.broker.groups_recreated >= 1
    assert running.worker.ready and running.worker.jobs.held == 0
    gone_lines = [r for r in caplog.records if "consumer group" in r.getMessage()]
    assert 1 <= len(gone_lines) <= 3


async def test_a_restart_without_persistence_under_load(start_worker: Any) -> None:
    server = RedisServer()  # no data dir: no AOF, no RDB
    server.start()
    queue = "no-persistence"
    try:
        running = await start_worker(redis_url=server.url, queue=queue, **QUICK)
        async with raw_events(server.url) as recorder:
            async with AsyncProducer(server.url, queue=queue) as producer:
                inflight = [
                    (await producer.submit(f"long {i}", max_new_tokens=200)).id for i in range(4)
                ]
                await _running(recorder, inflight)
            server.stop()
            await asyncio.sleep(0.5)
            server.start()
            took_s = await _serves_new_jobs(server.url, queue)
            await wait_until(lambda: running.worker.jobs.held == 0, 10)
            await asyncio.sleep(0.5)
        print(f"\nrestart: new jobs served in {took_s:.2f}s; repeats={len(recorder.repeats())}")
        assert recorder.repeats() == {}
        assert all(not _after_lost(recorder, j) for j in inflight)
        # Its subscriber may be reconnecting when the news goes out; it never hears it twice.
        assert all(_errors(recorder, j) <= 1 for j in inflight)
        assert running.worker.broker.groups_recreated >= 1
        assert running.worker.ready
        client = aioredis.Redis.from_url(server.url)
        assert await client.exists(QueueKeys(queue).jobs)
        await client.aclose()
    finally:
        server.stop()


async def test_readiness_stays_down_while_reads_fail_though_other_commands_work(
    start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats, renewals and trims succeed every 50 ms; the queue is not served."""
    running = await start_worker(heartbeat_seconds=0.05, trim_interval_seconds=0.05)
    worker = running.worker

    async def refused(count: int, block_ms: int | None) -> Any:
        await asyncio.sleep(0.01)
        raise ResponseError("NOPERM this user has no permissions to run the 'xreadgroup' command")

    monkeypatch.setattr(worker.broker, "read", refused)
    await wait_until(lambda: not worker.ready, 5)
    samples = []
    for _ in range(40):
        samples.append(worker.ready)
        await asyncio.sleep(0.05)
    assert samples.count(True) == 0
    monkeypatch.undo()
    await wait_until(lambda: worker.ready, 10)
