"""Every entry whose id can be read gets an answer on that id's channel: one no parser
reads (too deep, not UTF-8), one that names two ids (both hear), one whose id has ended
(it is not run again, and hears why); and the worker goes on serving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.protocol.models import ErrorEvent, Event, parse_event
from exlq.worker.broker import Broker
from exlq.worker.commit_batch import Batch, Final
from exlq.worker.lanes import TakePlan
from tests.conftest import RunningWorker

pytestmark = pytest.mark.integration

DEEP = 100_000


async def _answers(
    client: aioredis.Redis, keys: QueueKeys, payload: bytes, job_ids: list[str]
) -> dict[str, list[Event]]:
    """XADD a raw payload, as a producer without the SDK would, and return what each id's
    channel carries up to its end (done or error)."""
    pubsub = client.pubsub()
    await pubsub.subscribe(*(keys.events(job_id) for job_id in job_ids))
    events: dict[str, list[Event]] = {job_id: [] for job_id in job_ids}
    try:
        for _ in job_ids:
            await pubsub.get_message(timeout=1)  # the confirmations
        await client.xadd(keys.jobs, {"job": payload})
        async with asyncio.timeout(10):
            while not all(seen and seen[-1].type in ("done", "error") for seen in events.values()):
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message:
                    channel = message["channel"].decode()
                    [job_id] = [j for j in job_ids if keys.events(j) == channel]
                    events[job_id].append(parse_event(message["data"]))
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
    return events


async def _dead_letters(client: aioredis.Redis, keys: QueueKeys, count: int) -> list[Any]:
    """The dead stream's entries, once it holds ``count``, and the group has none pending."""
    async with asyncio.timeout(5):
        while await client.xlen(keys.dead) < count:
            await asyncio.sleep(0.02)
        while (await client.xpending(keys.jobs, CONSUMER_GROUP))["pending"]:
            await asyncio.sleep(0.02)
    return [fields for _, fields in await client.xrange(keys.dead)]


async def _still_serves(redis_url: str, queue_name: str) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        result = await (await producer.submit("still here", max_new_tokens=2)).result(timeout=10)
    assert result.text == " still here"


def _failed_count(running: RunningWorker, queue: str, code: str) -> float | None:
    return running.metrics.registry.get_sample_value(
        "exlq_jobs_failed_total", {"queue": queue, "error_type": code}
    )


@pytest.mark.parametrize(
    ("payload", "job_ids", "says"),
    [
        (
            b'{"id":"deep","prompt":"x","metadata":' + b"[" * DEEP + b"]" * DEEP + b"}",
            ["deep"],
            "recursion limit",
        ),
        (b'{"id":"not-utf8","prompt":"\xff\xfe"}', ["not-utf8"], "Invalid JSON"),
        (
            b'{"id":"twin-a","prompt":"x","id":"twin-b"}',
            ["twin-a", "twin-b"],
            "names 'id' 2 times ('twin-a', 'twin-b'); a job has one id",
        ),
    ],
    ids=["deep", "not-utf8", "two-ids"],
)
async def test_each_id_an_unreadable_entry_names_hears_why(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    payload: bytes,
    job_ids: list[str],
    says: str,
) -> None:
    running = await start_worker()
    keys = QueueKeys(queue_name)
    answers = await _answers(redis_client, keys, payload, job_ids)
    for job_id in job_ids:
        [event] = answers[job_id]  # the error alone: the job never ran
        assert isinstance(event, ErrorEvent) and event.error.code == "invalid_request"
        assert says in event.error.message
        stored = json.loads(await redis_client.get(keys.result(job_id)))
        assert stored["state"] == "failed" and says in stored["error"]["message"]
        assert await redis_client.hget(keys.job(job_id), "state") == b"failed"
    [dead] = await _dead_letters(redis_client, keys, 1)  # one entry, one dead letter
    assert dead[b"error"] == b"invalid_request" and says in dead[b"message"].decode()
    assert _failed_count(running, queue_name, "invalid_request") == 1
    await _still_serves(redis_url, queue_name)


async def test_a_rejected_entry_leaves_a_job_another_entry_runs_alone(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """Of the two ids an entry names, the one another entry runs keeps its own events."""
    await start_worker(echo_tokens_per_second=20.0)
    keys = QueueKeys(queue_name)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("slow words", id="busy", max_new_tokens=10)
        async with asyncio.timeout(10):
            while await redis_client.hget(keys.job("busy"), "state") != b"running":
                await asyncio.sleep(0.02)
        payload = b'{"id":"busy","prompt":"x","id":"free"}'
        answers = await _answers(redis_client, keys, payload, ["free"])
        result = await handle.result(timeout=10)
    assert [e.type for e in answers["free"]] == ["error"]
    assert result.state == "done" and result.text.split()[:2] == ["slow", "words"]
    stored = json.loads(await redis_client.get(keys.result("busy")))
    assert stored["state"] == "done"


@pytest.mark.parametrize(
    ("first", "ended_as"),
    [
        (b'{"id":"again","prompt":"fixed","max_new_tokens":2}', "done"),
        (b'{"id":"again","prompt":"fixed","max_new_tokens":0}', "failed"),  # rejected
    ],
    ids=["after-done", "after-rejected"],
)
async def test_an_entry_whose_id_has_ended_is_not_run_and_hears_why(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    first: bytes,
    ended_as: str,
) -> None:
    running = await start_worker()
    keys = QueueKeys(queue_name)
    [first_end] = (await _answers(redis_client, keys, first, ["again"]))["again"][-1:]
    assert first_end.type == ("done" if ended_as == "done" else "error")
    result_before = await redis_client.get(keys.result("again"))
    job_before = await redis_client.hgetall(keys.job("again"))
    dead_before = await redis_client.xlen(keys.dead)

    corrected = b'{"id":"again","prompt":"fixed","max_new_tokens":3}'
    [event] = (await _answers(redis_client, keys, corrected, ["again"]))["again"]
    assert isinstance(event, ErrorEvent) and event.error.code == "duplicate_id"
    assert f"ended already ({ended_as})" in event.error.message
    assert "submit the job under a new id" in event.error.message
    *_, dead = await _dead_letters(redis_client, keys, dead_before + 1)
    assert dead[b"error"] == b"duplicate_id"
    assert json.loads(dead[b"job"])["max_new_tokens"] == 3
    assert await redis_client.get(keys.result("again")) == result_before  # untouched
    assert await redis_client.hgetall(keys.job("again")) == job_before
    assert _failed_count(running, queue_name, "duplicate_id") == 1
    await _still_serves(redis_url, queue_name)


async def test_an_entry_whose_id_runs_elsewhere_is_skipped_in_silence(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """A producer's retried XADD while its job runs: the job's own events answer."""
    await start_worker(echo_tokens_per_second=20.0)
    keys = QueueKeys(queue_name)
    request = b'{"id":"retried","prompt":"one two","max_new_tokens":6}'
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(keys.events("retried"))
    await pubsub.get_message(timeout=1)
    try:
        await redis_client.xadd(keys.jobs, {"job": request})
        async with asyncio.timeout(10):
            while await redis_client.hget(keys.job("retried"), "state") != b"running":
                await asyncio.sleep(0.02)
        await redis_client.xadd(keys.jobs, {"job": request})
        events: list[Event] = []
        async with asyncio.timeout(10):
            while not events or events[-1].type not in ("done", "error"):
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message:
                    events.append(parse_event(message["data"]))
        await asyncio.sleep(0.3)  # an extra event would come right behind
        assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1) is None
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
    assert events[-1].type == "done"
    assert await redis_client.xlen(keys.dead) == 0
    assert (await redis_client.xpending(keys.jobs, CONSUMER_GROUP))["pending"] == 0


async def test_an_entry_with_several_finals_is_acked_once_by_its_last(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """Broker.commit: finals with ack=False write their job's answer and leave the entry
    pending for the one that acks it; an entry another worker owns is reported lost once."""
    keys = QueueKeys(queue_name)
    broker = Broker.from_url(redis_url, keys, "worker-a", result_ttl_s=600, dead_max_len=100)
    other = Broker.from_url(redis_url, keys, "worker-b", result_ttl_s=600, dead_max_len=100)
    try:
        await broker.ensure_group()
        await redis_client.xadd(keys.jobs, {"job": "{}"})
        await redis_client.xadd(keys.jobs, {"job": "{}"})
        [mine] = (await broker.read(TakePlan.any_lane(1), None)).entries
        [theirs] = (await other.read(TakePlan.any_lane(1), None)).entries
        batch = Batch()
        for entry in (mine, theirs):
            for job_id, ack in ((f"{entry.entry_id}-a", False), (f"{entry.entry_id}-b", True)):
                batch.finish(
                    Final(entry.entry_id, job_id=job_id, state="failed", result_json="{}", ack=ack)
                )
        lost = await broker.commit(batch)
    finally:
        await broker.close()
        await other.close()
    assert lost == [(theirs.entry_id, "taken")]
    for suffix in ("a", "b"):
        assert await redis_client.get(keys.result(f"{mine.entry_id}-{suffix}")) == b"{}"
        assert await redis_client.get(keys.result(f"{theirs.entry_id}-{suffix}")) is None
    pending = await redis_client.xpending_range(keys.jobs, CONSUMER_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [theirs.entry_id]
