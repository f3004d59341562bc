"""A job sent to a queue that no live worker serves does not wait in silence: its handle
raises NoWorkers (and the job is cancelled), or, with wait_for_worker, warns and waits.
A submit itself never reads the heartbeats."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from exlq import AsyncProducer, NoWorkers, Producer
from exlq.producer import worker_watch
from exlq.protocol.keys import QueueKeys

pytestmark = pytest.mark.integration

CHECK_S = 0.3


@pytest.fixture(autouse=True)
def _quick_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("exlq.producer.client.WORKER_CHECK_S", CHECK_S)


@pytest.fixture
def heartbeat_reads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times the SDK read the workers' heartbeats."""
    reads: list[float] = []
    read = worker_watch.WorkerWatch._read

    async def counted(self: worker_watch.WorkerWatch) -> bool:
        reads.append(time.monotonic())
        return await read(self)

    monkeypatch.setattr(worker_watch.WorkerWatch, "_read", counted)
    return reads


async def _heartbeat(client: aioredis.Redis, queue: str, age_s: float) -> None:
    info = {"engine": "echo", "capacity": 1, "load": 0, "last_seen": time.time() - age_s}
    await client.hset(QueueKeys(queue).workers, "elsewhere:1", json.dumps(info))


async def test_a_job_no_worker_serves_raises_no_workers_and_is_cancelled(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("nobody here", max_new_tokens=2)
        started = time.monotonic()
        with pytest.raises(NoWorkers, match=f"job {handle.id} was not started") as raised:
            await handle.result(timeout=10)
        assert time.monotonic() - started < CHECK_S + 2
        assert raised.value.queue == queue_name and raised.value.job_id == handle.id
        assert f"no live worker serves queue {queue_name!r}" in str(raised.value)
        assert "wait_for_worker=True" in str(raised.value)
        # A worker that starts later does not run it.
        await start_worker()
        status = None
        for _ in range(200):
            status = await producer.status(handle.id)
            if status is not None and status.state != "queued":
                break
            await asyncio.sleep(0.02)
        assert status is not None and status.state == "cancelled"


async def test_a_heartbeat_older_than_the_stale_time_is_no_worker(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    await _heartbeat(redis_client, queue_name, age_s=31)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("stale", max_new_tokens=2)
        with pytest.raises(NoWorkers):
            await handle.result(timeout=10)


async def test_a_live_heartbeat_lets_a_job_wait_behind_others(
    redis_url: str, queue_name: str, start_worker: Any, heartbeat_reads: list[float]
) -> None:
    # One slot, taken by a long job: the short one waits past the check and is not touched.
    await start_worker(max_batch_size=1, echo_tokens_per_second=100.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        long = await producer.submit("long", max_new_tokens=80)
        short = await producer.submit("short", max_new_tokens=2)
        assert (await short.result(timeout=20)).text == " short short"
        assert (await long.result(timeout=20)).state == "done"
    assert len(heartbeat_reads) == 1  # the short job's check, answered "served"


async def test_submits_read_no_heartbeats(
    redis_url: str, queue_name: str, start_worker: Any, heartbeat_reads: list[float]
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = await asyncio.gather(
            *(producer.submit(f"burst {i}", max_new_tokens=2) for i in range(64))
        )
        await asyncio.gather(*(h.result(timeout=20) for h in handles))
    assert heartbeat_reads == []


async def test_waiting_handles_share_one_read(
    redis_url: str, queue_name: str, heartbeat_reads: list[float]
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = await asyncio.gather(
            *(producer.submit(f"many {i}", max_new_tokens=2) for i in range(20))
        )
        outcomes = await asyncio.gather(
            *(h.result(timeout=10) for h in handles), return_exceptions=True
        )
    assert all(isinstance(outcome, NoWorkers) for outcome in outcomes)
    assert len(heartbeat_reads) == 1


async def test_wait_for_worker_warns_once_then_the_jobs_run_when_a_worker_starts(
    redis_url: str, queue_name: str, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="exlq")
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        first = await producer.submit("early one", max_new_tokens=2)
        second = await producer.submit("early two", max_new_tokens=2)
        waits = [asyncio.ensure_future(h.result(timeout=20)) for h in (first, second)]
        await asyncio.sleep(CHECK_S + 0.5)
        warnings = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert f"no live worker serves queue {queue_name!r}" in warnings[0]
        assert not any(w.done() for w in waits)
        await start_worker()
        texts = [r.text for r in await asyncio.gather(*waits)]
    assert texts == [" early one", " early two"]


@pytest.fixture
async def user_without_heartbeats(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> AsyncIterator[str]:
    """A producer user that may use its queue's jobs but not read the workers' hash."""
    base = f"exlq:{{{queue_name}}}"
    name = "no-heartbeats"
    await redis_client.acl_setuser(
        name,
        enabled=True,
        passwords=["+pw"],
        keys=[f"{base}:job*", f"{base}:result:*"],
        channels=["*"],
        commands=["+@all"],
    )
    yield redis_url.replace("redis://", f"redis://{name}:pw@", 1)
    await redis_client.acl_deluser(name)


async def test_a_user_who_may_not_read_the_heartbeats_waits_with_a_warning(
    user_without_heartbeats: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="exlq")
    async with AsyncProducer(user_without_heartbeats, queue=queue_name) as producer:
        handle = await producer.submit("unchecked", max_new_tokens=2)
        with pytest.raises(TimeoutError):
            await handle.result(timeout=CHECK_S + 0.5)
        status = await producer.status(handle.id)
    assert status is not None and status.state == "queued"  # not cancelled
    assert "cannot read the workers' heartbeats" in caplog.text


def test_the_blocking_producer_raises_no_workers_too(redis_url: str, queue_name: str) -> None:
    with Producer(redis_url, queue=queue_name) as producer:
        handle = producer.submit("nobody", max_new_tokens=2)
        with pytest.raises(NoWorkers):
            handle.result(timeout=10)


async def test_heartbeats_kept_otherwise_than_as_a_hash_are_not_a_reason_to_refuse(
    redis_url: str,
    queue_name: str,
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The wire contract allows a zset for the heartbeats: a newer worker's is not read here.
    await redis_client.zadd(QueueKeys(queue_name).workers, {"elsewhere:1": time.time()})
    caplog.set_level(logging.WARNING, logger="exlq")
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("unread", max_new_tokens=2)
        with pytest.raises(TimeoutError):
            await handle.result(timeout=CHECK_S + 0.5)
    assert "cannot read the workers' heartbeats (WRONGTYPE" in caplog.text


async def test_redis_away_at_the_check_is_waited_out(
    redis_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def away(self: worker_watch.WorkerWatch) -> bool:
        raise RedisConnectionError("Redis is restarting")

    monkeypatch.setattr(worker_watch.WorkerWatch, "served", away)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("patient", max_new_tokens=2)
        with pytest.raises(TimeoutError):  # neither the connection error nor NoWorkers
            await handle.result(timeout=CHECK_S + 0.5)
