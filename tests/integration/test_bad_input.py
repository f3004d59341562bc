"""Malformed entries get an error event and a dead-letter entry; the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.protocol.models import ErrorEvent, parse_event

pytestmark = pytest.mark.integration


async def _raw_job(
    client: aioredis.Redis, keys: QueueKeys, payload: str, job_id: str | None
) -> list[Any]:
    """XADD a raw payload and return what its channel carries until the end."""
    pubsub = client.pubsub()
    events: list[Any] = []
    if job_id is not None:
        await pubsub.subscribe(keys.events(job_id))
        await pubsub.get_message(timeout=1)  # subscription confirmed
    await client.xadd(keys.jobs, {"job": payload})
    if job_id is not None:
        async with asyncio.timeout(10):
            while not events or events[-1].type not in ("done", "error"):
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message:
                    events.append(parse_event(message["data"]))
    await pubsub.aclose()
    return events


@pytest.mark.parametrize(
    ("payload", "job_id", "says"),
    [
        ('{"id": "bad-json", "prompt": "x", ', None, "Invalid JSON"),
        ('{"id": "unknown-field", "prompt": "x", "colour": "red"}', "unknown-field", "colour"),
        ('{"id": "too-long", "prompt": "x", "max_new_tokens": 0}', "too-long", "max_new_tokens"),
        (
            '{"id": "too-many", "prompt": "x", "max_new_tokens": 10000000}',
            "too-many",
            "max_new_tokens",
        ),
        ('{"id": "no-input", "max_new_tokens": 5}', "no-input", "exactly one of prompt"),
        ('["not", "an", "object"]', None, "request"),
    ],
)
async def test_malformed_entry_is_dead_lettered_and_worker_goes_on(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    payload: str,
    job_id: str | None,
    says: str,
) -> None:
    await start_worker()
    keys = QueueKeys(queue_name)
    events = await _raw_job(redis_client, keys, payload, job_id)
    if job_id is not None:
        assert len(events) == 1 and isinstance(events[0], ErrorEvent)
        assert events[0].error.code == "invalid_request"
        assert says in events[0].error.message
        stored = json.loads(await redis_client.get(keys.result(job_id)))
        assert stored["state"] == "failed" and says in stored["error"]["message"]

    async with asyncio.timeout(5):
        while not await redis_client.xlen(keys.dead):
            await asyncio.sleep(0.02)
    [(_, dead)] = await redis_client.xrange(keys.dead)
    assert dead[b"error"] == b"invalid_request"
    assert says in dead[b"message"].decode()
    assert dead[b"job"].decode() == payload
    assert (await redis_client.xpending(keys.jobs, CONSUMER_GROUP))["pending"] == 0

    # The worker still serves.
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        result = await (await producer.submit("still here", max_new_tokens=2)).result(timeout=10)
    assert result.text == " still here"


async def test_entry_without_job_field_is_dead_lettered(
    queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    running = await start_worker()
    keys = QueueKeys(queue_name)
    await redis_client.xadd(keys.jobs, {"payload": "{}"})
    async with asyncio.timeout(5):
        while not await redis_client.xlen(keys.dead):
            await asyncio.sleep(0.02)
    assert (
        running.metrics.registry.get_sample_value(
            "exlq_jobs_failed_total", {"queue": queue_name, "error_type": "invalid_request"}
        )
        == 1
    )
