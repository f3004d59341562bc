"""200 jobs through 2 workers: nothing lost, nothing twice, no worker over capacity."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer, DoneEvent, TokenEvent
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys

pytestmark = pytest.mark.integration

JOBS = 200
CAPACITY = 8


async def _watch_pending(
    client: aioredis.Redis, keys: QueueKeys, peak: Counter[str], stop: asyncio.Event
) -> None:
    """Sample what Redis says each consumer holds, and keep the highest count seen."""
    while not stop.is_set():
        summary = await client.xpending(keys.jobs, CONSUMER_GROUP)
        for consumer in summary.get("consumers") or []:
            name = consumer["name"].decode()
            peak[name] = max(peak[name], int(consumer["pending"]))
        await asyncio.sleep(0.005)


async def test_two_workers_serve_200_jobs_exactly_once(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    # No trim during the test: the stream's length below counts every entry written.
    workers = [
        await start_worker(max_batch_size=CAPACITY, trim_interval_seconds=3600.0) for _ in range(2)
    ]
    keys = QueueKeys(queue_name)
    peak_pending: Counter[str] = Counter()
    stop_watch = asyncio.Event()
    watcher = asyncio.create_task(_watch_pending(redis_client, keys, peak_pending, stop_watch))

    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [
            await producer.submit(f"job {i} says hello", max_new_tokens=5 + i % 20)
            for i in range(JOBS)
        ]

        async def collect(handle: Any) -> tuple[list[Any], str]:
            events = [event async for event in handle.stream()]
            result = await handle.result(timeout=30)
            return events, result.text

        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 60)
    stop_watch.set()
    await watcher

    for handle, (events, stored_text) in zip(handles, outcomes, strict=True):
        assert [e.seq for e in events] == list(range(len(events))), handle.id
        assert sum(isinstance(e, DoneEvent) for e in events) == 1
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == stored_text
        assert all(e.id == handle.id for e in events)

    # Every entry acknowledged once, nothing left pending.
    assert (await redis_client.xpending(keys.jobs, CONSUMER_GROUP))["pending"] == 0
    assert await redis_client.xlen(keys.jobs) == JOBS
    completed = [w.worker for w in workers]
    assert all(w.peak_held <= CAPACITY for w in completed)
    assert all(count <= CAPACITY for count in peak_pending.values()), peak_pending
    # Both workers took part.
    assert len(peak_pending) == 2
    served = [
        w.metrics.registry.get_sample_value(
            "exlq_jobs_completed_total",
            {"queue": queue_name, "lane": "interactive", "finish_reason": "length"},
        )
        or 0
        for w in workers
    ]
    assert sum(served) == JOBS and min(served) > 0
