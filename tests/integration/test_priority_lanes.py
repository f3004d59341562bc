"""Priority lanes through a real Redis and worker: the interactive lane goes first, the
batch lane is never starved, its reserve keeps a slot for interactive jobs, and a batch job
has the same guarantees as any other (events, result, ack, takeover)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer, JobResult
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.worker.broker import Broker
from exlq.worker.lanes import TakePlan

pytestmark = pytest.mark.integration


def _started_at(result: JobResult) -> float:
    assert result.timings is not None
    return result.timings.queued_s


async def test_a_batch_job_runs_and_is_counted_in_its_lane(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    running = await start_worker()
    keys = QueueKeys(queue_name)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("one two three", max_new_tokens=3, priority="batch")
        result = await handle.result(timeout=10)
        assert result.state == "done" and result.text.split() == ["one", "two", "three"]
        with pytest.raises(ValueError, match="not a lane"):
            await producer.submit("x", priority="urgent")
    entry = (await redis_client.hget(keys.job(handle.id), "entry")).decode()
    assert entry.endswith("@batch")
    assert await redis_client.xlen(keys.lane_jobs("batch")) <= 1
    pending = await redis_client.xpending(keys.lane_jobs("batch"), CONSUMER_GROUP)
    assert pending["pending"] == 0  # acked in the batch lane's stream
    value = running.metrics.registry.get_sample_value
    batch = {"queue": queue_name, "lane": "batch"}
    assert value("exlq_jobs_received_total", batch) == 1
    assert value("exlq_jobs_received_total", {"queue": queue_name, "lane": "interactive"}) == 0
    assert value("exlq_jobs_completed_total", {**batch, "finish_reason": "length"}) == 1
    assert value("exlq_time_to_first_token_seconds_count", batch) == 1


async def test_interactive_jobs_start_before_batch_jobs_queued_earlier(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        batch = [
            await producer.submit(f"batch {i}", max_new_tokens=5, priority="batch")
            for i in range(8)
        ]
        interactive = [
            await producer.submit(f"interactive {i}", max_new_tokens=5) for i in range(4)
        ]
        # Two slots, no minimum for the batch lane: every interactive job starts before the
        # batch jobs queued ahead of them.
        await start_worker(max_batch_size=2, echo_tokens_per_second=100.0, batch_min_slots=0)
        done_batch = [await h.result(timeout=30) for h in batch]
        done_interactive = [await h.result(timeout=30) for h in interactive]
    assert max(_started_at(r) for r in done_interactive) < min(_started_at(r) for r in done_batch)


async def test_a_busy_interactive_lane_never_starves_the_batch_lane(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        interactive = [
            await producer.submit(f"interactive {i}", max_new_tokens=5) for i in range(20)
        ]
        batch = await producer.submit("batch", max_new_tokens=5, priority="batch")
        await start_worker(max_batch_size=2, echo_tokens_per_second=100.0)
        batch_result = await batch.result(timeout=30)
        results = [await h.result(timeout=30) for h in interactive]
    # Twenty interactive jobs for two slots, all queued before it: the batch job still ran
    # among the first (its lane keeps one slot), not after them all.
    assert sum(_started_at(r) > _started_at(batch_result) for r in results) >= 15


async def test_the_batch_lane_leaves_reserved_slots_for_interactive_jobs(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    running = await start_worker(
        max_batch_size=4, echo_tokens_per_second=40.0, interactive_reserved_slots=1
    )
    gauge = running.metrics.registry.get_sample_value
    labels = {"queue": queue_name, "lane": "batch"}
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        batch_submitted = time.time()
        batch = [
            await producer.submit(f"batch {i}", max_new_tokens=20, priority="batch")
            for i in range(8)
        ]
        while (gauge("exlq_jobs_running", labels) or 0) < 3:
            await asyncio.sleep(0.01)
        most = 3.0
        # Three batch jobs run and a slot stays free: an interactive job starts at once, not
        # when a batch job ends.
        submitted = time.time()
        job = await producer.submit("interactive", max_new_tokens=2)
        answer = asyncio.ensure_future(job.result(timeout=10))
        while not answer.done():
            most = max(most, gauge("exlq_jobs_running", labels) or 0)
            await asyncio.sleep(0.005)
        result = answer.result()
        batch_results = await asyncio.gather(*(h.result(timeout=30) for h in batch))
    first_batch_end = batch_submitted + min(
        r.timings.total_s for r in batch_results if r.timings is not None
    )
    assert submitted + _started_at(result) < first_batch_end
    assert most == 3


@pytest.mark.parametrize("burst", [True, False], ids=["burst", "one-by-one"])
async def test_batch_jobs_landing_while_a_read_waits_never_fill_the_reserved_slot(
    redis_url: str, queue_name: str, start_worker: Any, burst: bool
) -> None:
    """Batch entries that land while the worker's read waits come in through the wait, the
    take behind it and the read-ahead of a burst: together they never take the reserved
    slot, so the worker never holds more batch jobs than its capacity less the reserve."""
    running = await start_worker(
        max_batch_size=4, echo_tokens_per_second=40.0, interactive_reserved_slots=1
    )
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        prompts = [f"batch {i}" for i in range(8)]
        if burst:  # submitted at once: the SDK marks the burst, the worker reads it ahead
            batch = await asyncio.gather(
                *(producer.submit(p, max_new_tokens=10, priority="batch") for p in prompts)
            )
        else:
            batch = [await producer.submit(p, max_new_tokens=10, priority="batch") for p in prompts]
        results = await asyncio.gather(*(h.result(timeout=30) for h in batch))
    assert [r.state for r in results] == ["done"] * 8
    assert running.worker.peak_held == 3


async def test_a_batch_job_that_ends_under_the_reserve_is_replaced_without_waiting(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    """With the reserve full and no interactive job, the worker's read waits for one; a
    batch job that ends meanwhile frees a slot the batch lane may fill, and the next batch
    job starts then, not when the read's wait (here 5 s) runs out."""
    await start_worker(
        max_batch_size=4,
        echo_tokens_per_second=100.0,
        interactive_reserved_slots=1,
        read_block_ms=5000,
    )
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        batch = [
            await producer.submit(f"batch {i}", max_new_tokens=10, priority="batch")
            for i in range(9)
        ]
        # Three rounds of three jobs of a tenth of a second each, far inside one wait.
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in batch)), 4.0)
    assert [r.state for r in results] == ["done"] * 9


async def test_a_batch_entry_of_a_stopped_worker_is_taken_over(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    stopped = Broker.from_url(redis_url, keys, "stopped-worker", result_ttl_s=60, dead_max_len=10)
    try:
        await stopped.ensure_group()
        async with AsyncProducer(redis_url, queue=queue_name) as producer:
            handle = await producer.submit("taken over", max_new_tokens=2, priority="batch")
            # A worker reads the entry, then stops without a word.
            [entry] = (await stopped.read(TakePlan.any_lane(1), None)).entries
            assert entry.lane == "batch"
            await start_worker(claim_idle_ms=300)
            result = await handle.result(timeout=20)
    finally:
        await stopped.close()
    assert result.state == "done" and result.text.split() == ["taken", "over"]
    pending = await redis_client.xpending(keys.lane_jobs("batch"), CONSUMER_GROUP)
    assert pending["pending"] == 0
