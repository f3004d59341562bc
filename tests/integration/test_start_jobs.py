"""Broker.start_jobs: one script decides every entry of a read, each on its own."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer.keys import QueueKeys
from worker.broker import Broker

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


async def test_a_job_key_of_the_wrong_type_fails_the_start_with_the_reason(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.set(keys.job("squatted"), "not a job hash")
    broker = Broker.from_url(redis_url, keys, "worker-a", result_ttl_s=600, dead_max_len=100)
    try:
        with pytest.raises(ResponseError, match=r"starting a job failed: .*WRONGTYPE"):
            await broker.start_jobs([("squatted", "1-0")])
    finally:
        await broker.close()
