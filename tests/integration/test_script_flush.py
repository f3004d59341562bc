"""Redis forgetting its scripts (SCRIPT FLUSH, a restart) stops neither submits nor starts."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from producer import AsyncProducer

pytestmark = pytest.mark.integration


async def test_jobs_run_after_every_script_is_flushed(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        first = await (await producer.submit("before the flush", max_new_tokens=2)).result(10)
        await redis_client.script_flush()
        second = await (await producer.submit("after the flush", max_new_tokens=2)).result(10)
    assert (first.state, second.state) == ("done", "done")
    assert second.text.split() == ["after", "the"]
