"""Broker.start_jobs: one script decides every entry of a read, each on its own."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys
from exlq.worker.broker import Broker

pytestmark = pytest.mark.integration


async def test_each_job_of_a_read_gets_its_own_verdict_from_one_script(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.hset(keys.job("fresh"), mapping={"state": "queued", "entry": "1-0"})
    await redis_client.hset(keys.job("finished"), mapping={"state": "done", "entry": "2-0"})
    await redis_client.hset(keys.job("twin"), mapping={"state": "queued", "entry": "3-0"})
    await redis_client.hset(
        keys.job("cancelled"), mapping={"state": "queued", "entry": "4-0", "cancel": "1"}
    )
    broker = Broker.from_url(redis_url, keys, "worker-a", result_ttl_s=600, dead_max_len=100)
    try:
        await broker.start_jobs([("warm-up", "0-1")])  # Redis has the script now
        await redis_client.config_resetstat()
        decisions = await broker.start_jobs(
            [("fresh", "1-0"), ("finished", "2-0"), ("twin", "9-0"), ("cancelled", "4-0")]
        )
        stats = await redis_client.info("commandstats")
    finally:
        await broker.close()
    assert [(d.verdict, d.detail) for d in decisions] == [
        ("run", "1"),
        ("ended", "done"),
        ("duplicate", "3-0"),
        ("cancel", "0"),
    ]
    calls = stats.get("cmdstat_evalsha", {}).get("calls", 0) + stats.get("cmdstat_eval", {}).get(
        "calls", 0
    )
    assert calls == 1
    fresh = await redis_client.hgetall(keys.job("fresh"))
    assert fresh[b"state"] == b"running"
    assert fresh[b"worker"] == b"worker-a"
    assert fresh[b"attempts"] == b"1"
    assert 0 < await redis_client.ttl(keys.job("fresh")) <= 600
    assert (await redis_client.hgetall(keys.job("twin")))[b"state"] == b"queued"


async def test_a_job_key_of_the_wrong_type_fails_that_job_alone(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.set(keys.job("squatted"), "not a job hash")
    await redis_client.hset(keys.job("fine"), mapping={"state": "queued", "entry": "2-0"})
    broker = Broker.from_url(redis_url, keys, "worker-a", result_ttl_s=600, dead_max_len=100)
    try:
        squatted, fine = await broker.start_jobs([("squatted", "1-0"), ("fine", "2-0")])
    finally:
        await broker.close()
    assert squatted.verdict == "error"
    assert "WRONGTYPE" in squatted.detail
    assert (fine.verdict, fine.detail) == ("run", "1")


async def test_a_worker_dead_letters_a_job_it_cannot_start_and_runs_the_rest(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis, start_worker: Any
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.set(keys.job("squatted"), "not a job hash")
    events = redis_client.pubsub()
    await events.subscribe(keys.events("squatted"))
    await events.get_message(timeout=1)  # the confirmation
    for job_id in ("squatted", "fine"):  # as a producer without the SDK would enqueue them
        request = {"id": job_id, "prompt": f"{job_id} job", "max_new_tokens": 2}
        await redis_client.xadd(keys.jobs, {"job": json.dumps(request)})
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        done = None
        for _ in range(100):
            done = await producer.get_result("fine")
            if done is not None:
                break
            await asyncio.sleep(0.1)
    assert done is not None and done.state == "done"
    message = None
    for _ in range(50):
        message = await events.get_message(timeout=0.2)
        if message is not None and message["type"] == "message":
            break
    assert message is not None and message["type"] == "message"
    event = json.loads(message["data"])
    assert event["type"] == "error"
    assert event["error"]["code"] == "internal_error"
    assert keys.job("squatted") in event["error"]["message"]
    await events.aclose()
    [(_, dead)] = await redis_client.xrange(keys.dead)
    assert json.loads(dead[b"job"])["id"] == "squatted"
    assert dead[b"error"] == b"internal_error"
    assert (await redis_client.xpending(keys.jobs, "workers"))["pending"] == 0
    assert await redis_client.get(keys.job("squatted")) == b"not a job hash"
