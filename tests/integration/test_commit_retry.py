"""Events and their metrics: a batch whose write fails is written again, and its subscribers
miss nothing; every token is counted."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from exlq.producer import AsyncProducer
from exlq.protocol.models import TokenEvent

pytestmark = pytest.mark.integration


async def test_a_failed_commit_is_retried_and_no_event_is_lost(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    running = await start_worker(echo_tokens_per_second=200.0)
    worker = running.worker
    commit = worker.broker.commit
    calls: list[int] = []

    async def failing_twice(batch: Any) -> list[str]:
        calls.append(len(batch))
        if len(calls) in (2, 3):  # two writes in a row fail
            raise RedisConnectionError("connection reset by peer")
        return await commit(batch)

    worker.broker.commit = failing_twice
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("retried", max_new_tokens=6)
        events = [event async for event in handle.stream()]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.seq for e in events] == list(range(len(events)))  # none lost, none doubled
    assert "".join(e.text for e in tokens) == " retried" * 6
    assert len(calls) >= 4  # the failed batch went again, then the rest


async def test_the_token_metrics_count_every_token_of_every_job(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    # They are observed after each batch's write has gone out, not before it.
    running = await start_worker(echo_tokens_per_second=300.0)
    value = running.metrics.registry.get_sample_value
    labels = {"queue": queue_name}
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [await producer.submit(f"job {i}", max_new_tokens=6) for i in range(3)]
        results = [await h.result(timeout=20) for h in handles]
    assert [r.usage.completion_tokens for r in results if r.usage] == [6, 6, 6]
    assert value("exlq_generated_tokens_total", labels) == 18
    lane = {**labels, "lane": "interactive"}
    assert value("exlq_time_to_first_token_seconds_count", lane) == 3
    assert value("exlq_inter_token_latency_seconds_count", labels) == 15
    ttft_sum = value("exlq_time_to_first_token_seconds_sum", lane)
    assert ttft_sum is not None and 0 < ttft_sum < 3 * 10
