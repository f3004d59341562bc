"""Redis forgetting its scripts (SCRIPT FLUSH, a restart) stops neither submits nor starts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys

pytestmark = pytest.mark.integration


async def test_jobs_run_after_every_script_is_flushed(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    running = await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        first = await (await producer.submit("before the flush", max_new_tokens=2)).result(10)
        await redis_client.script_flush()
        # A burst: one pipeline whose every call answers NOSCRIPT, then runs again.
        handles = await asyncio.gather(
            *(producer.submit(f"after flush {i}", max_new_tokens=3) for i in range(3))
        )
        assert not any(h.duplicate for h in handles)
        after = await asyncio.gather(*(h.result(10) for h in handles))
    # Each submit enqueued one entry, the NOSCRIPT retry none more. Counted as the worker
    # read them, not by the stream's length: the worker's first trim, at its start, may
    # come after the first job's end and take its entry.
    received = running.metrics.registry.get_sample_value(
        "exlq_jobs_received_total", {"queue": queue_name, "lane": "interactive"}
    )
    assert received == 4
    assert await redis_client.xlen(QueueKeys(queue_name).jobs) in (3, 4)
    assert first.state == "done"
    for i, result in enumerate(after):
        assert result.state == "done"
        assert result.text.split() == ["after", "flush", str(i)]
