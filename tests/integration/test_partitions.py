"""A queue split in partitions: every job is served once from the partition its id picks,
an id submitted twice is one job, cancel and status find a job wherever it is, a worker
reads the partitions fairly, and a crashed worker's jobs finish on another."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer, DoneEvent, TokenEvent
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys, partition_of
from exlq.protocol.models import GenerationRequest
from exlq.protocol.slot_routing import client_like
from exlq.worker.broker import Broker
from exlq.worker.engines.echo.engine import echo_text
from exlq.worker.lanes import TakePlan
from tests.conftest import wait_until, worker_process
from tests.integration.test_crash_recovery import FAST_RECLAIM, _kill

pytestmark = [pytest.mark.integration, pytest.mark.cluster_too]

PARTITIONS = 4


def ids_in(partition: int, count: int, stem: str) -> Iterator[str]:
    """``count`` job ids whose partition is ``partition``."""
    found = 0
    for n in range(10_000):
        job_id = f"{stem}-{n}"
        if partition_of(job_id, PARTITIONS) == partition:
            yield job_id
            found += 1
            if found == count:
                return


async def _entries_by_partition(redis_client: aioredis.Redis, queue: str) -> dict[int, list[str]]:
    """The job ids in each partition's stream, and check nothing is left pending."""
    found: dict[int, list[str]] = {}
    for n in range(PARTITIONS):
        keys = QueueKeys(queue).of_partition(n)
        client = client_like(redis_client, keys.jobs)
        try:
            entries = await client.xrange(keys.jobs)
            pending = await client.xpending(keys.jobs, CONSUMER_GROUP)
        finally:
            await client.aclose(close_connection_pool=True)
        assert pending["pending"] == 0
        found[n] = [GenerationRequest.model_validate_json(f[b"job"]).id for _, f in entries]
    return found


async def test_jobs_spread_over_the_partitions_and_each_is_served_once(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    await start_worker(partitions=PARTITIONS)
    await start_worker(partitions=PARTITIONS)
    assert await redis_client.get(QueueKeys(queue_name).partitions) == b"4"
    prompts = [f"job number {i}" for i in range(40)]
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = await asyncio.gather(*(producer.submit(p, max_new_tokens=6) for p in prompts))
        results = await asyncio.gather(*(h.result(timeout=30) for h in handles))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.text == echo_text(GenerationRequest(prompt=prompt, max_new_tokens=6))
        assert result.attempts == 1
    by_partition = await _entries_by_partition(redis_client, queue_name)
    assert sorted(i for ids in by_partition.values() for i in ids) == sorted(h.id for h in handles)
    for n, ids in by_partition.items():
        assert ids, f"partition {n} got no job of 40"
        assert all(partition_of(job_id, PARTITIONS) == n for job_id in ids)


async def test_an_id_submitted_twice_is_one_job_whichever_producer_sends_it(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(partitions=PARTITIONS)
    async with (
        AsyncProducer(redis_url, queue=queue_name) as first,
        AsyncProducer(redis_url, queue=queue_name) as second,
    ):
        job_ids = [next(ids_in(n, 1, "twice")) for n in range(PARTITIONS)]
        originals = [await first.submit("once", id=i, max_new_tokens=4) for i in job_ids]
        again = [await second.submit("once", id=i, max_new_tokens=4) for i in job_ids]
        assert not any(h.duplicate for h in originals)
        assert all(h.duplicate for h in again)
        ran = [await h.result(timeout=20) for h in originals + again]
    assert {r.text for r in ran} == {echo_text(GenerationRequest(prompt="once", max_new_tokens=4))}
    assert {r.attempts for r in ran} == {1}


async def test_cancel_and_status_find_a_job_in_any_partition(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(partitions=PARTITIONS, echo_tokens_per_second=20)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        job_ids = [next(ids_in(n, 1, "cancel")) for n in range(PARTITIONS)]
        handles = [await producer.submit("slow", id=i, max_new_tokens=200) for i in job_ids]
        streams = [h.stream() for h in handles]
        for stream in streams:  # each has started
            assert isinstance(await asyncio.wait_for(anext(stream), 10), TokenEvent)
        for job_id in job_ids:
            status = await producer.status(job_id)
            assert status is not None and status.state == "running"
            assert await producer.cancel(job_id) == "running"
        for stream in streams:
            events = [event async for event in stream]
            assert isinstance(events[-1], DoneEvent)
            assert events[-1].finish_reason == "cancelled"
        for job_id in job_ids:
            result = await producer.get_result(job_id)
            assert result is not None and result.finish_reason == "cancelled"


async def test_a_worker_with_one_slot_reads_the_partitions_in_turn(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """A backlog in one partition does not hold back a job in another: the job of
    partition 2 starts among the first jobs, not after the 16 ahead of it in partition 0."""
    await redis_client.set(QueueKeys(queue_name).partitions, PARTITIONS)
    ended: list[str] = []
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        backlog = [await producer.submit("x", id=i, max_new_tokens=3) for i in ids_in(0, 16, "b")]
        other = await producer.submit("x", id=next(ids_in(2, 1, "other")), max_new_tokens=3)

        async def end(handle: Any) -> None:
            await handle.result(timeout=30)
            ended.append(handle.id)

        await start_worker(partitions=1, max_batch_size=1, echo_tokens_per_second=2000)
        await asyncio.gather(*(end(h) for h in [*backlog, other]))
    assert len(ended) == 17
    assert ended.index(other.id) < PARTITIONS, ended


async def test_a_worker_reads_as_many_partitions_as_the_queue_has(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """The count is raised, never lowered; a worker started before a raise reads the new
    partitions from its next heartbeat on, and serves their jobs."""
    first = await start_worker(heartbeat_seconds=0.2)  # the queue of one partition
    assert len(first.worker.broker.parts) == 1
    await start_worker(partitions=2, heartbeat_seconds=0.2)
    larger = await start_worker(partitions=PARTITIONS, heartbeat_seconds=0.2)
    late = await start_worker()  # EXLQ_PARTITIONS left at 1: never lowers the count
    assert await redis_client.get(QueueKeys(queue_name).partitions) == b"4"
    assert len(larger.worker.broker.parts) == len(late.worker.broker.parts) == PARTITIONS
    await wait_until(lambda: len(first.worker.broker.parts) == PARTITIONS, 5.0)
    await larger.shutdown()
    await late.shutdown()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [await producer.submit("x", id=i, max_new_tokens=2) for i in ids_in(3, 3, "g")]
        results = [await handle.result(timeout=20) for handle in handles]
    assert [r.state for r in results] == ["done"] * 3


async def test_a_killed_workers_jobs_finish_on_another_in_every_partition(
    redis_url: str, queue_name: str
) -> None:
    env = {**FAST_RECLAIM, "EXLQ_PARTITIONS": str(PARTITIONS)}
    slow = ("--engine", "echo", "-o", "tokens_per_second=20")
    doomed = worker_process(redis_url, queue_name, *slow, **env)
    survivor = None
    try:
        async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
            job_ids = [next(ids_in(n, 1, "crash")) for n in range(PARTITIONS)]
            # Submitted once the worker has set the count, so that each lands in its own.
            await _wait_for_count(redis_url, queue_name)
            handles = [await producer.submit("a b c", id=i, max_new_tokens=30) for i in job_ids]
            streams = [h.stream() for h in handles]
            for stream in streams:
                assert isinstance(await asyncio.wait_for(anext(stream), 30), TokenEvent)
            doomed.send_signal(signal.SIGKILL)
            survivor = worker_process(redis_url, queue_name, "--engine", "echo", **env)
            async with asyncio.timeout(60):
                for stream in streams:
                    [_ async for _ in stream]
            results = [await h.result(timeout=10) for h in handles]
    finally:
        _kill(doomed)
        if survivor is not None:
            survivor.send_signal(signal.SIGTERM)
            _kill(survivor)
    expected = echo_text(GenerationRequest(prompt="a b c", max_new_tokens=30))
    assert [r.text for r in results] == [expected] * PARTITIONS
    assert all(r.attempts == 2 for r in results)


async def _wait_for_count(redis_url: str, queue: str) -> None:
    seed = aioredis.Redis.from_url(redis_url)
    client = client_like(seed, QueueKeys(queue).partitions)
    try:
        async with asyncio.timeout(60):
            while await client.get(QueueKeys(queue).partitions) != b"4":
                await asyncio.sleep(0.1)
    finally:
        await client.aclose(close_connection_pool=True)
        await seed.aclose(close_connection_pool=True)


@pytest.mark.parametrize("slots", [8, 1], ids=["slots-for-every-partition", "one-slot"])
async def test_an_idle_worker_starts_a_job_in_any_partition_at_once(
    redis_url: str, queue_name: str, start_worker: Any, slots: int
) -> None:
    """An idle worker waits on every partition (or, with fewer slots than partitions, on
    some at a time, briefly): a job in any of them starts well within the 1 s a wait lasts."""
    await start_worker(partitions=PARTITIONS, max_batch_size=slots, read_block_ms=1000)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        for n in range(PARTITIONS):
            await asyncio.sleep(0.3)  # the worker is waiting again
            handle = await producer.submit("x", id=next(ids_in(n, 1, "idle")), max_new_tokens=1)
            result = await handle.result(timeout=10)
            assert result.timings is not None
            assert result.timings.queued_s < 0.3, (n, result.timings)


async def test_an_idle_worker_with_few_slots_takes_over_a_stopped_workers_entry(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """Its waits on the partitions hold every free slot while it is idle: a reclaim still
    takes over the entry a stopped worker read in partition 2."""
    await redis_client.set(QueueKeys(queue_name).partitions, PARTITIONS)
    keys = QueueKeys(queue_name).of_partition(2)
    stopped = Broker.from_url(redis_url, keys, "stopped-worker", result_ttl_s=60, dead_max_len=10)
    try:
        await stopped.ensure_group()
        async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
            handle = await producer.submit("taken over", id=next(ids_in(2, 1, "stop")))
            [entry] = (await stopped.read(TakePlan.any_lane(1), None)).entries
            running = await start_worker(max_batch_size=2, claim_idle_ms=300)
            await wait_until(lambda: running.worker.broker.reserved_slots == 2)  # both slots
            result = await handle.result(timeout=20)
    finally:
        await stopped.close()
    assert entry.entry_id
    assert result.state == "done" and result.text.startswith(" taken over")
