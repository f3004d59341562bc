"""A batch of events whose write fails is written again: its subscribers miss nothing."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producer import AsyncProducer
from producer.protocol import TokenEvent

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
